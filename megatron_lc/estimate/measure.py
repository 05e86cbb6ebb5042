"""Measured peak of the framework's own training steps on CPU: the calibration target of the memory model.

What is measured: the peak of the bytes of *live tensor storages*, tracked at the dispatcher. A
``TorchDispatchMode`` sees every op's outputs (parameters, gradients, optimizer states, activations, communication
buffers the framework allocates, autograd's backward included); each new storage is counted until a weak reference
to it fires (the storage is freed, in whatever thread drops it last). This is the CPU twin of
``torch.cuda.max_memory_allocated`` restricted to tensors the program holds: no allocator caching, no
fragmentation, no interpreter or library memory.

Why not the alternatives: peak RSS mixes in ~300 MB of interpreter and library pages and glibc keeps freed pages.
The profiler's allocator events (``profile_memory=True``) are exact in one process (they agree with this tracker
to < 0.1% on the tiny model, docs/estimator.md) but miss frees that happen on gloo's worker threads -- a collective's
``Work`` object sometimes drops the last reference to its tensors there -- so in multi-rank runs they drift upward
by whatever was freed off the main thread. What this tracker cannot see: buffers a kernel allocates and frees inside
one op (CPU attention scratch, gloo's flattened all-gather staging); they are not in the model either.

    from megatron_lc.estimate.measure import measure_training_peak
    peak = measure_training_peak(cfg, topo, steps=2)   # {"peak_bytes": ..., "final_bytes": ..., "losses": [...]}

Run it in a fresh process per measurement (the tests use ``tests/dist.run_dist``); every rank measures its own peak.
"""
from __future__ import annotations

import copy
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..training.loop import Trainer


class LiveStorageTracker(TorchDispatchMode):
    """Bytes of live storages created under the mode; ``peak_bytes`` is their running maximum."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        self.current_bytes = 0
        self.peak_bytes = 0

    def _freed(self, key: int) -> None:
        with self._lock:
            self.current_bytes -= self._live.pop(key, 0)
            self._refs.pop(key, None)

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        if st.data_ptr() == 0:
            return
        key, n = id(st), st.nbytes()
        with self._lock:
            old = self._live.get(key)
            if old is None:
                self._refs[key] = weakref.ref(st, lambda _r, k=key: self._freed(k))
                old = 0
            elif old == n:
                return
            self._live[key] = n  # new storage, or one that an op resized
            self.current_bytes += n - old
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def measure_training_peak(cfg, topo, steps: int = 2) -> dict:
    """Build the trainer and run ``steps`` steps under the tracker; returns this rank's peak of live tensor bytes.

    The model, optimizer and data are built inside the tracked region, so the peak counts every tensor of the run
    (parameters included)."""
    cfg = copy.deepcopy(cfg)
    cfg.train.train_iters = steps
    tracker = LiveStorageTracker()
    with tracker:
        trainer = Trainer(cfg, topo, torch.device("cpu"))
        trainer.train()
    return {"peak_bytes": tracker.peak_bytes, "final_bytes": tracker.current_bytes,
            "losses": list(trainer.state.losses)}
