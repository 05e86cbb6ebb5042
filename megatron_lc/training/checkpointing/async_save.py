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
interleave with the training step's collectives. Cost: a host copy of this rank's weights and AdamW states while a
save is in flight (16 bytes per parameter of the rank's shard in fp32 with AdamW).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ...config import Config
from ...parallel.collectives import host_backend
from ...parallel.topology import Topology
from .save import SaveJob, begin_save, finish_save, together
from .sharded_state import wait_written, write_async

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
        started = []
        together(self.topo, job.final, job.tmp, lambda: started.append(write_async(job.tmp, job.tensors, self.group)))
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
