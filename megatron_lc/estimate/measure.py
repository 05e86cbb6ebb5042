"""Measured peak of the framework's own training steps on CPU: the calibration target of the memory model.

What is measured: the peak of *live bytes in torch's CPU allocator* over a run, from the profiler's memory events
(``torch.profiler.profile(profile_memory=True)`` records every allocation and free made through c10's allocator,
kernel-internal buffers included). This is the CPU twin of ``torch.cuda.max_memory_allocated``: tensor bytes, no
allocator caching, no fragmentation, no Python/heap overhead. Peak RSS was not used: glibc keeps freed pages, the
interpreter and torch's libraries add ~300 MB of noise, and the difference of two RSS peaks mixes both.

    from megatron_lc.estimate.measure import measure_training_peak
    peak = measure_training_peak(cfg, topo, steps=2)   # {"peak_bytes": ..., "final_bytes": ...}

Run it in a fresh process per measurement (the tests use ``tests/dist.run_dist``), every rank measures its own peak.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("megatron_lc")


def peak_from_profile(prof) -> dict:
    """Peak and final live bytes from a finished ``torch.profiler.profile(profile_memory=True)``."""
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e[0])
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    return {"peak_bytes": peak, "final_bytes": cur, "events": len(events)}


def measure_training_peak(cfg, topo, steps: int = 2) -> dict:
    """Build the trainer and run ``steps`` steps under the memory profiler; returns this rank's peak live bytes.

    The model, optimizer and data are built inside the profiled region, so the peak counts every tensor of the run
    (parameters included), starting from an empty allocator."""
    from torch.profiler import ProfilerActivity, profile

    from ..training.loop import Trainer

    cfg.train.train_iters = steps
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        trainer = Trainer(cfg, topo, torch.device("cpu"))
        trainer.train()
    out = peak_from_profile(prof)
    out["losses"] = list(trainer.state.losses)
    return out
