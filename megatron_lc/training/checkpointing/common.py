"""What loading and saving share: the format version, the checksums of a checkpoint's files, the ranks' barrier and
the optimizer kind a checkpoint records.

The ranks share the hashing of a directory's files round-robin over the sorted names (4 files on 2 ranks: rank 0
hashes ``a, c``, rank 1 ``b, d``); ``topo`` None hashes them all in this process (an import, a tool), and so does a
rehearsal's simulated rank, which also does rank 0's part (``leads``)."""
from __future__ import annotations

import hashlib
import os
from typing import Optional

import torch.distributed as dist

from ...parallel.collectives import fake_world
from ...parallel.topology import Topology

FORMAT_VERSION = 3  # 3: torch.distributed.checkpoint; 2: torch files per tp rank, checksums; 1: no checksums


def file_digest(path: str) -> dict:
    """``{"bytes": size, "sha256": hex}`` of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return {"bytes": os.path.getsize(path), "sha256": h.hexdigest()}


def leads(topo: Topology) -> bool:
    """Whether this rank does a checkpoint's shared work (the directories, ``meta.json``, the rename, pruning):
    rank 0 -- and every simulated rank of a rehearsal, alone in its process under a fake process group, with no
    rank 0 beside it to do that part (``parallel.collectives.fake_world``)."""
    return topo.rank == 0 or fake_world()


def file_share(names: list, topo: Optional[Topology]) -> list:
    """This rank's share of ``names`` (sorted; round-robin over the ranks), for hashing and checking files; all of
    them for one process alone (``topo`` None, or a rehearsal's simulated rank: ``leads``)."""
    names = sorted(names)
    return names if topo is None or fake_world() else names[topo.rank::topo.world_size]


def file_checksums(directory: str, topo: Optional[Topology]) -> dict:
    """Size and sha256 of this rank's share of the files in ``directory`` (``topo`` None: all of them)."""
    return {n: file_digest(os.path.join(directory, n)) for n in file_share(os.listdir(directory), topo)}


def barrier(topo: Topology) -> None:
    """Every rank waits here (nothing to wait for in one process)."""
    if topo.world_size > 1:
        dist.barrier()


def uses_zero(opt) -> bool:
    """Whether ``opt`` is ZeRO-1 (torch's ZeroRedundancyOptimizer): its states are saved per dp x cp rank."""
    return type(opt).__name__ == "ZeroRedundancyOptimizer"
