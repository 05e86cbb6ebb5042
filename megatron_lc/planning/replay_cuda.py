"""GPU: replay a whole plan through PyTorch's pluggable allocator (the route DESIGN.md settled on: a process-wide
``CUDAPluggableAllocator`` + ``change_current_allocator``, set before any CUDA allocation; ``memory_stats`` stop
working). ``csrc/plan_alloc.c`` holds the replay: the k-th request of an iteration gets ``arena + offset[k]`` when
its size matches the plan and its range is free; otherwise the backend allocator serves it and a counter records
the divergence (one warning per iteration from ``check``).

    replay = PlanReplay.install(plan)        # GPU; before any CUDA tensor exists (never executed here: no GPU)
    replay.attach(model)                     # plan_begin_iteration() on every forward of the model
    ...
    replay.check()                           # logs a warning when requests diverged from the plan

``PlanReplay.host_twin(plan)`` builds the same C file with ``-DPLAN_ALLOC_HOST`` (host ``malloc``) and drives it
through ctypes: the tests replay traces through the very code the GPU would run, minus ``cudaMalloc``.
Limits: one plan per process and device; the plan is of one micro-batch (with gradient accumulation, later
micro-batches that allocate differently fall back); requests are matched by order and size, not by identity.

Not safe with side streams, so off: nothing in training installs it. A pluggable allocator is handed no stream
events: a block freed on the compute stream while a side-stream copy (FPDT's and Memo's offload / prefetch) still
reads or writes it would be handed out again at once -- the caching allocator avoids that with ``record_stream``,
which the pluggable route does not provide. Under it ``torch.cuda.max_memory_allocated`` also raises (the training
metrics then report no peak). ``memory.plan: auto`` uses the framework arena (``memory/arena.py``), which does
track side-stream use of its buffers.
"""
from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import tempfile

import numpy as np
import torch

from .plan import Plan

log = logging.getLogger("megatron_lc")
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "plan_alloc.c")


def build(host: bool, out_dir: str | None = None) -> str:
    """Compile ``plan_alloc.c`` to a shared library; returns its path (gcc; ``-lcudart`` for the GPU build)."""
    out_dir = out_dir or tempfile.mkdtemp(prefix="plan_alloc_")
    so = os.path.join(out_dir, "plan_alloc_host.so" if host else "plan_alloc.so")
    cmd = ["gcc", "-O2", "-shared", "-fPIC", SRC, "-o", so]
    if host:
        cmd.insert(1, "-DPLAN_ALLOC_HOST")
    else:  # pragma: no cover - GPU only
        cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        cmd += [f"-L{cuda}/lib64", "-lcudart"]
    subprocess.run(cmd, check=True, capture_output=True)
    return so


class PlanReplay:
    def __init__(self, so_path: str, plan: Plan, base: int | None = None):
        self.so_path, self.plan = so_path, plan
        self.lib = ctypes.CDLL(so_path)
        L = ctypes.c_longlong
        self.lib.plan_load.argtypes = [L, ctypes.c_int, ctypes.POINTER(L), ctypes.POINTER(L), ctypes.c_void_p]
        self.lib.plan_malloc.restype = ctypes.c_void_p
        self.lib.plan_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.plan_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.lib.plan_arena_base.restype = ctypes.c_void_p
        self.lib.plan_stats.argtypes = [ctypes.POINTER(L)]
        sizes = np.array([plan.sizes[i] for i in plan.order], dtype=np.int64)
        offs = np.array([plan.offsets[i] for i in plan.order], dtype=np.int64)
        rc = self.lib.plan_load(plan.peak_bytes, len(sizes), sizes.ctypes.data_as(ctypes.POINTER(L)),
                                offs.ctypes.data_as(ctypes.POINTER(L)), base)
        if rc != 0:
            raise MemoryError(f"plan_alloc: cannot allocate the arena of {plan.peak_bytes} bytes (code {rc})")
        self._warned = 0

    @classmethod
    def host_twin(cls, plan: Plan) -> "PlanReplay":
        return cls(build(host=True), plan)

    @classmethod
    def install(cls, plan: Plan) -> "PlanReplay":  # pragma: no cover - GPU only, never executed here
        so = build(host=False)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(so, "plan_malloc", "plan_free")
        torch.cuda.memory.change_current_allocator(alloc)
        return cls(so, plan)

    def base(self) -> int:
        return self.lib.plan_arena_base()

    def begin_iteration(self) -> None:
        self.lib.plan_begin_iteration()

    def end_iteration(self) -> None:
        self.lib.plan_end_iteration()

    def malloc(self, size: int) -> int:
        return self.lib.plan_malloc(size, 0, None)

    def free(self, ptr: int, size: int = 0) -> None:
        self.lib.plan_free(ptr, size, 0, None)

    def stats(self) -> dict:
        out = (ctypes.c_longlong * 4)()
        self.lib.plan_stats(out)
        return {"hits": out[0], "fallbacks": out[1], "outside_iteration": out[2], "live_planned": out[3]}

    def attach(self, model) -> None:
        """Begin a planned iteration on every forward of ``model``."""
        model.register_forward_pre_hook(lambda *_: self.begin_iteration())

    def check(self) -> None:
        s = self.stats()
        if s["fallbacks"] > self._warned:
            log.warning("plan replay: %d requests diverged from the plan so far and were allocated normally",
                        s["fallbacks"])
            self._warned = s["fallbacks"]
