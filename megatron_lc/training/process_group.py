"""Process setup: logging, torch.distributed (gloo on CPU, nccl on GPU), the topology, the device.

Runs as one process (``python pretrain_gpt.py``) or under ``torchrun`` (RANK / WORLD_SIZE / LOCAL_RANK set)."""
from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from ..config import Config, ConfigError, Layout, resolve_layout
from ..parallel.fsdp import start_one_process_group
from ..parallel.topology import Topology


def setup_logging(rank: int) -> None:
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(level=level, format=f"[%(asctime)s rank{rank}] %(message)s", datefmt="%H:%M:%S", force=True)
    for noisy in ("megatron", "megatron.core"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def choose_threads(cores: int, local_ranks: int, load: float) -> int:
    """Intra-op threads for each of ``local_ranks`` ranks on ``cores`` cores while other work keeps ``round(load)``
    of them busy (the 1-minute load average). Threads that outnumber the free cores wait for each other at every
    op's barrier: the demo's model as one process on 2 cores under a load of 6 ran 20 s a step with 2 threads, 3.5 s
    with 1.

    >>> choose_threads(2, 1, 6.2), choose_threads(2, 1, 0.1), choose_threads(2, 2, 0.1), choose_threads(16, 4, 0.4)
    (1, 2, 1, 4)
    """
    return max(1, (cores - round(load)) // local_ranks)


def set_threads() -> str:
    """Set this rank's intra-op threads before any work; returns the line that says the choice and why.
    ``OMP_NUM_THREADS`` when set (torchrun sets 1 for several local ranks; ``scripts/slurm/launch.sh`` the node's
    cores per rank); else ``choose_threads`` over the cores this process may run on (its CPU affinity), the ranks
    of this node (``LOCAL_WORLD_SIZE``) and the load when it starts."""
    if os.environ.get("OMP_NUM_THREADS"):
        return f"intra-op threads: {torch.get_num_threads()} a rank (OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = choose_threads(cores, local, load)
    torch.set_num_threads(threads)
    ranks = f", {local} ranks on this node" if local > 1 else ""
    return (f"intra-op threads: {threads} a rank ({cores} cores available{ranks}, 1-minute load {load:.1f}; "
            f"OMP_NUM_THREADS sets another)")


def env_world() -> tuple[int, int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def cuda_connections(layout: Layout) -> None:
    """``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware work queue: kernels start in launch order) only where
    tensor-parallel overlap needs it, tp > 1: the tp collectives start before the GEMMs queued after them. With
    tp = 1 one queue would serialise FSDP2's all-gathers, ring attention's transfers and the offload copies behind
    minutes-long attention kernels, so it is left unset there (a value the user set is kept, and said). CUDA reads
    it when the context is made: call before the process's first CUDA call."""
    if layout.tp > 1 and MAX_CONNECTIONS not in os.environ:
        os.environ[MAX_CONNECTIONS] = "1"
    elif layout.tp == 1 and os.environ.get(MAX_CONNECTIONS) == "1":
        logging.getLogger(__name__).warning(
            "%s=1 with tp 1 serialises FSDP2's gathers, ring transfers and offload copies behind the attention "
            "kernels; unset it unless you mean it", MAX_CONNECTIONS)


def pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.train.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device is cuda but no CUDA device is available (use cpu or auto)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def process_group_backend(cfg: Config, device: torch.device) -> str:
    """``parallel.distributed_backend``, ``auto`` resolved: gloo for a CPU run; for a CUDA run NCCL for device
    tensors and gloo for CPU ones (``cpu:gloo,cuda:nccl``; the groups of ``Topology.build`` inherit both), so the
    step's CPU flags and counts never reach NCCL."""
    backend = cfg.parallel.distributed_backend
    if backend == "auto":
        return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    return backend


def init_distributed(cfg: Config) -> tuple[Layout, Topology, torch.device]:
    """Resolve the layout for this world size, start the process group and build the topology."""
    rank, world, local_rank = env_world()
    layout = resolve_layout(cfg, world)  # one-line ConfigError before any process group exists
    cuda_connections(layout)  # before the first CUDA call of the process
    device = pick_device(cfg, local_rank)
    timeout = datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(process_group_backend(cfg, device), timeout=timeout)
    elif cfg.parallel.use_torch_fsdp2 and not dist.is_initialized():  # FSDP2 needs a process group, even of one
        start_one_process_group(process_group_backend(cfg, device), timeout)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, timeout=timeout, ep=layout.ep)
    return layout, topo, device


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
