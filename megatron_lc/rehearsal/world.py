"""One simulated rank of a job: the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, as torchrun sets them) and a fake process group (``torch.testing._internal.distributed
.fake_pg``: every collective returns at once, with no other rank and no data) for the host's tensors and the
device's, as a CUDA run's ``cpu:gloo,cuda:nccl`` (``cpu:fake,standin:fake`` with the stand-in device). Example, rank
9 of 4 nodes x 8: ``LOCAL_RANK=1``, ``LOCAL_WORLD_SIZE=8``; the host budget is then shared by 8 ranks, as on the
node."""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(rank: int, world: int, nproc_per_node: int, device: torch.device = torch.device("cpu")):
    """Inside: torch.distributed initialised with the fake backend as ``rank`` of ``world``, for the host and
    ``device``."""
    env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank % nproc_per_node,
           "LOCAL_WORLD_SIZE": nproc_per_node}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    backend = "fake" if device.type == "cpu" else f"cpu:fake,{device.type}:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
