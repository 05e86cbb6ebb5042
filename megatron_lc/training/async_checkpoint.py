"""Asynchronous checkpoints (``checkpoint.async_save``): torch.distributed.checkpoint's ``async_save`` copies the
weights and AdamW states to host memory (staging, while the step waits) and writes them from a background thread
while training goes on. At most one save is in flight: the next save, and the end of training, first wait for it and
then finish it -- checksums, ``meta.json``, the rename of ``iter_N.tmp`` to ``iter_N`` (``checkpoint.finish_save``,
the same code as a synchronous save), on every rank at the same step. A checkpoint is complete only when renamed with
its ``meta.json``; a process killed while its save is being written leaves ``iter_N.tmp`` behind, the previous
checkpoint stays the newest that loads, and the next run says so (``unfinished_saves``).

The background writes coordinate the ranks over a process group of their own (gloo, made once), so they never
interleave with the training step's collectives. Cost: a host copy of this rank's weights and AdamW states while a
save is in flight (16 bytes per parameter of the rank's shard in fp32 with AdamW).
"""
from __future__ import annotations

import logging
import os
import re
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ..config import Config
from ..parallel.topology import Topology
from .checkpoint import begin_save, finish_save, save_state
from .checkpoint_dir import complete_iterations

log = logging.getLogger("megatron_lc")


def unfinished_saves(save: Optional[str]) -> list[str]:
    """``iter_N.tmp`` directories under ``save`` newer than its newest complete checkpoint: saves a killed process did
    not finish (the next save removes them)."""
    if not save or not os.path.isdir(save):
        return []
    done = complete_iterations(save)
    newest = done[-1] if done else -1
    return sorted(os.path.join(save, n) for n in os.listdir(save)
                  if (m := re.fullmatch(r"iter_(\d{7})\.tmp", n)) and int(m.group(1)) > newest)


@dataclass
class _InFlight:
    future: object  # dcp.async_save's Future of the background write
    opt: object  # the optimizer (meta.json records whether it is ZeRO-1)
    tmp: str
    final: str
    iteration: int
    consumed_samples: int
    has_optim: bool
    started: float


class AsyncCheckpointer:
    """``save`` starts a checkpoint and returns after staging; ``wait`` finishes the one in flight. Every rank calls
    both at the same steps. ``stall_seconds``: what each save cost the training loop (waiting for the previous one,
    staging), for logs and ``bench/async_checkpoint.py``."""

    def __init__(self, cfg: Config, topo: Topology):
        self.cfg, self.topo = cfg, topo
        self.pending: Optional[_InFlight] = None
        self.stall_seconds: list[float] = []
        distributed = dist.is_available() and dist.is_initialized()
        # the background writes' own group: their collectives never meet the step's (made once, by every rank)
        self.group = dist.new_group(backend="gloo") if distributed and topo.world_size > 1 else None
        self.no_dist = not distributed
        for path in unfinished_saves(cfg.checkpoint.save) if topo.rank == 0 else []:
            log.warning("%s: a checkpoint save that did not finish (the process stopped while it was written); "
                        "the newest complete checkpoint is the one to load, and the next save removes it", path)

    def save(self, model, opt, iteration: int, consumed_samples: int) -> str:
        """Start the checkpoint of ``iteration`` (after finishing the one in flight); returns its final directory."""
        t0 = time.perf_counter()
        self.wait()
        tmp, final = begin_save(self.cfg, self.topo, iteration)
        state, has_optim = save_state(model, opt, self.topo)
        with warnings.catch_warnings():  # DCP warns that a single process is assumed: that is what we asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            future = dcp.async_save(state, checkpoint_id=tmp, process_group=self.group, no_dist=self.no_dist)
        self.pending = _InFlight(future, opt, tmp, final, iteration, consumed_samples, has_optim, time.perf_counter())
        self.stall_seconds.append(time.perf_counter() - t0)
        log.info("checkpoint %s: staged in %.2f s, written in the background", final, self.stall_seconds[-1])
        return final

    def wait(self) -> Optional[str]:
        """Finish the save in flight, if any (every rank); returns its directory."""
        p, self.pending = self.pending, None
        if p is None:
            return None
        p.future.result()  # the background write's error, if any, is raised here
        path = finish_save(self.cfg, self.topo, p.opt, p.tmp, p.final, p.iteration,
                           p.consumed_samples, p.has_optim)
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
