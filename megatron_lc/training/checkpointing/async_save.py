"""Asynchronous checkpoints (``checkpoint.async_save``): the phases of a synchronous save (``checkpoint_save.py``)
with the state written in the background. ``begin_save`` checks the state finite and makes ``iter_N.tmp`` while the
step waits; torch.distributed.checkpoint's ``async_save`` (``sharded_state.write_async``) copies the weights and
AdamW states to host memory (staging, the step still waits) and writes them from a background thread while training
goes on. At most one save is in flight: the next save, and the end of training, first wait for it and then finish
it -- RNG files, checksums, ``meta.json``, the rename of ``iter_N.tmp`` to ``iter_N`` (``finish_save``, the same code
as a synchronous save), on every rank at the same step. A failed background write is the synchronous save's one
line (``CheckpointWriteError``) when it is waited for. A checkpoint is complete only when renamed with its
``meta.json``; a process killed while its save is being written leaves ``iter_N.tmp`` behind, the previous
checkpoint stays the newest that loads, and the next run says so (``checkpoint.load_checkpoint``).

The background writes coordinate the ranks over a process group of their own (gloo, made once), so they never
interleave with the training step's collectives.

Staging: one area for the life of the run, made at the first save and reused by every later one -- DCP's own
``DefaultStager``, kept (its storages are cached by source storage), page-locked on CUDA with non-blocking copies
(``staging_options``). ``async_save`` without a stager builds a fresh one per call with none of that (torch's
state_dict_saver.py: ``DefaultStager(StagingOptions(False, False, False, False))``, closed after the write): pageable
memory, a synchronous copy and a new host allocation at every save. The area is the rank's state (16 bytes per
parameter of its shard with AdamW in fp32 and fp32 weights: weights, two moments; ``staging_bytes``), held on the
host beside the offload techniques' pool and counted with it against the host budget and in Memo's alpha LP
(``HostPool.hold``, before the calibrations: ``training/setup.py``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

from ...config import Config
from ...parallel.collectives import host_backend
from ...parallel.topology import Axis, Topology
from .save import SaveJob, begin_save, finish_save, together
from .sharded_state import wait_written, write_async

STAGING = "checkpoint staging"  # its share of the host budget (``HostPool.hold``)


def staging_options(device: torch.device) -> StagingOptions:
    """The stager's options for a run on ``device``: page-locked memory and non-blocking copies on CUDA (plain on
    the CPU twin, where pinning needs CUDA); no shared memory (the write runs in a thread of this process); staged
    synchronously -- the step waits for the copy, then trains while the thread writes (an asynchronous staging
    would race the next optimizer step)."""
    cuda = device.type == "cuda"
    return StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                          use_non_blocking_copy=cuda)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def staging_bytes(model, cfg: Config, topo: Topology) -> int:
    """The bytes the staging area holds for this rank's state, as DCP's stager copies it (whole storages): the
    model's local pieces (FSDP2: this rank's shards, their padding included), AdamW's two moments in the
    parameters' dtype and a 4-byte step count per parameter its optimizer steps -- all of them, or under ZeRO-1 at
    most 1/(dp x cp) of the moments plus the largest parameter's (the greedy partition's bound: a rank's share is
    the mean plus at most one parameter). Example: Llama3-8B with FSDP2 over 8 ranks, fp32: 8.03e9 / 8 x 12 bytes,
    12.0 GB a rank."""
    storages = {}
    moments = []
    for p in model.parameters():
        local = _local(p)
        storages[id(local.untyped_storage())] = local.untyped_storage().nbytes()
        moments.append(2 * local.numel() * local.element_size() + 4)
    n = topo.size(Axis.DP_CP)
    owned = sum(moments) if not (cfg.parallel.use_distributed_optimizer and n > 1) else \
        -(-sum(moments) // n) + max(moments, default=0)
    return sum(storages.values()) + owned


log = logging.getLogger("megatron_lc")


@dataclass
class _InFlight:
    future: object  # sharded_state.write_async's Future of the background write
    opt: object  # the optimizer (meta.json records whether it is ZeRO-1)
    job: SaveJob
    consumed_samples: int
    extra: Optional[dict]  # more meta.json fields (the skip counts at the save)
    started: float


class AsyncCheckpointer:
    """``save`` starts a checkpoint and returns after staging; ``wait`` finishes the one in flight. Every rank calls
    both at the same steps. ``stall_seconds``: what each save cost the training loop (waiting for the previous one,
    the finite check, staging), for logs and ``bench/async_checkpoint.py``."""

    def __init__(self, cfg: Config, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.stager: Optional[DefaultStager] = None  # made at the first save (its device: the state's), then reused
        self.pending: Optional[_InFlight] = None
        self.stall_seconds: list[float] = []
        distributed = dist.is_available() and dist.is_initialized()
        # the background writes' own group: their collectives never meet the step's (made once, by every rank), on
        # the default group's host backend (gloo; a rehearsal's fake one)
        self.group = dist.new_group(backend=host_backend()) if distributed and topo.world_size > 1 else None

    def save(self, model, opt, iteration: int, consumed_samples: int, extra: Optional[dict] = None) -> str:
        """Start the checkpoint of ``iteration`` (after finishing the one in flight); returns its final directory.
        ``extra``: more ``meta.json`` fields, as ``checkpoint_save.save_checkpoint`` takes them."""
        t0 = time.perf_counter()
        self.wait()
        job = begin_save(self.cfg, self.topo, model, opt, iteration)
        if self.stager is None:
            device = next((t.device for t in job.tensors.values() if _local(t).device.type != "cpu"),
                          torch.device("cpu"))
            self.stager = DefaultStager(staging_options(device))
        started = []
        together(self.topo, job.final, job.tmp,
                 lambda: started.append(write_async(job.tmp, job.tensors, self.group, self.stager)))
        self.pending = _InFlight(started[0], opt, job, consumed_samples, extra, time.perf_counter())
        self.stall_seconds.append(time.perf_counter() - t0)
        log.info("checkpoint %s: staged in %.2f s, written in the background", job.final, self.stall_seconds[-1])
        return job.final

    def wait(self) -> Optional[str]:
        """Finish the save in flight, if any (every rank); returns its directory."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        together(self.topo, p.job.final, p.job.tmp, lambda: wait_written(p.future))
        path = finish_save(self.cfg, self.topo, p.opt, p.job, p.consumed_samples, p.extra)
        log.info("saved checkpoint %s (written in the background in %.2f s)", path, time.perf_counter() - p.started)
        return path

    def abandon(self) -> None:
        """Training ends with an error: let the write in flight end, finish nothing (its ``.tmp`` stays incomplete;
        no collective, the other ranks may be gone)."""
        p, self.pending = self.pending, None
        if p is not None:
            try:
                p.future.result()
            except Exception:  # noqa: BLE001 - the run is failing already; this save is left incomplete
                pass
