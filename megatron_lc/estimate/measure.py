"""Measured peak of the framework's own training steps on CPU: the calibration target of the memory model.

What is measured: the peak of the bytes of *live tensor storages*, tracked at the dispatcher by the package's one
live-bytes tracker (``planning/capture/tracker.DispatchTracer``, also the memory planner's capture and a rehearsal's
counter). A ``TorchDispatchMode`` sees every op's outputs (parameters, gradients, optimizer states -- the local
shards inside FSDP2's DTensors --, activations, communication buffers the framework allocates, autograd's
backward included); each storage, keyed by identity, counts its current bytes: a malloc when an op creates it, a
free when a weak reference to it fires (in whatever thread drops it last), and ``resize_`` in between (FSDP2
frees every gathered layer with ``untyped_storage().resize_(0)`` and gathers into it again with ``resize_(n)``).
This is the CPU twin of ``torch.cuda.max_memory_allocated`` restricted to tensors the program holds: no allocator
caching, no fragmentation, no interpreter or library memory.

Why not the alternatives: peak RSS mixes in ~300 MB of interpreter and library pages and glibc keeps freed pages.
The profiler's allocator events (``profile_memory=True``) are exact in one process (they equal this tracker to the
byte on the FSDP2 step of ``tests/planning/test_tracker.py``) but miss frees that happen on gloo's worker threads -- a
collective's ``Work`` object sometimes drops the last reference to its tensors there -- so in multi-rank runs they
drift upward by whatever was freed off the main thread. What this tracker cannot see: buffers a kernel allocates
and frees inside one op (CPU attention scratch, gloo's flattened all-gather staging); they are not in the model
either.

    from megatron_lc.estimate.measure import measure_training_peak
    peak = measure_training_peak(cfg, topo, steps=2)
    # {"peak_bytes": ..., "final_bytes": ..., "losses": [...]}

Run it in a fresh process per measurement (the tests use ``tests/dist.run_dist``); every rank measures its own peak.
"""
from __future__ import annotations

import copy

import torch

from ..planning.capture.tracker import DispatchTracer
from ..training.loop import Trainer


def measure_training_peak(cfg, topo, steps: int = 2) -> dict:
    """Build the trainer and run ``steps`` steps under the tracker; returns this rank's peak of live tensor bytes
    and the bytes still held at the end.

    The model, optimizer and data are built inside the tracked region, so the peak counts every tensor of the run
    (parameters included)."""
    cfg = copy.deepcopy(cfg)
    cfg.train.train_iters = steps
    tracker = DispatchTracer()
    with tracker:
        trainer = Trainer(cfg, topo, torch.device("cpu"))
        trainer.train()
    return {"peak_bytes": tracker.peak().bytes, "final_bytes": tracker.live_bytes(),
            "losses": list(trainer.state.losses)}
