"""The host memory a rank may give its ``HostPool``: ``memory.host_memory_gb`` (a node's budget) or, by default,
``MemAvailable`` of /proc/meminfo, shared by the ranks of the node (counted by hostname). Example: 8 ranks on a node
with ``host_memory_gb: 1600`` -> 200 GiB per rank; the pool's exact size (every technique's reservation, and the
checkpoint staging beside it) is checked against it before the first step, and a pool that does not fit is one
``HostMemoryError`` naming the numbers. ``MemAvailable`` falls as the node's ranks allocate and pin, so setup has
every rank read it before any rank pins and agree on the smallest reading of the node (``training/setup.py``): a
rank that read after a neighbour pinned would otherwise refuse alone while the others wait in their first
collective."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from typing import Optional

from ..config import ConfigError
from ..units import GIB, fmt_bytes


class HostMemoryError(ConfigError):
    """The host memory the offload techniques need does not fit in this rank's budget."""


def available_host_bytes() -> float:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def ranks_on_this_node() -> int:
    """How many ranks of the job share this host: the launcher's ``LOCAL_WORLD_SIZE`` (torchrun, a rehearsal), else
    counted by hostname over the job (1 without torch.distributed)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def host_budget(host_memory_gb) -> tuple[float, str]:
    """(a node's host bytes for the pools, where the figure comes from: "config" | "MemAvailable")."""
    if host_memory_gb is not None:
        return float(host_memory_gb) * GIB, "config"
    return available_host_bytes(), "MemAvailable"


def host_share(host_memory_gb) -> tuple[float, str]:
    """This rank's share of its node's host memory as read now: (bytes, "config" | "MemAvailable")."""
    node, source = host_budget(host_memory_gb)
    return node / ranks_on_this_node(), source


def pool_budget_error(pool, share: float, source: str, rank: int, hint: str) -> Optional[str]:
    """The one line a pool that does not fit ``share`` (what the node's ranks agreed on) is refused with, naming every
    reservation and ``hint`` (what to change); None when it fits. The pool's bytes include what the run holds
    beside it on the host (``HostPool.beside``: the checkpoint staging area)."""
    if pool.budget_bytes <= share:
        return None
    shares = ", ".join(f"{tag} {fmt_bytes(n)}" for tag, n in {**pool.reserved, **pool.beside}.items())
    return (f"rank {rank}: the host pool needs {fmt_bytes(pool.budget_bytes)} ({shares}), over this rank's share "
            f"{fmt_bytes(share)} of the host memory ({source}, the smallest reading of its node's ranks); {hint}")
