"""The memory plan (``memory.plan``; ``planning/``, Memo sections 4.2-4.3): without one, PyTorch's caching allocator
fragments under long-context allocation patterns and a reserve is added on CUDA; ``auto`` traces and plans a
micro-batch at setup; a plan file is loaded as it is.

Example, Llama3-8B at 1M tokens on 8 H100s without a plan: 10% of the activation peak reserved (Memo's Table 4:
384K tokens without a plan against 640K with one); an assumption, never measured here.
"""
from __future__ import annotations

from dataclasses import replace

from .term import MemoryShare, Run, Term

FRAGMENTATION = 0.10  # of the activation peak, on CUDA without a plan


class CachingAllocator(Term):
    """No plan: on CUDA a share of the activation peak is reserved but unusable (none when the peak comes from a
    plan or trace given to the estimator; none on CPU, where the calibration measures live bytes)."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        if run.hw.device != "cuda" or run.peak_override is not None:
            return share
        return replace(share, fragmentation=FRAGMENTATION,
                       notes=share.notes + ("fragmentation reserve 10% of activations (memory.plan: off)",))


class PlanTracedAtSetup(Term):
    """``memory.plan: auto``: setup traces a micro-batch's forward and backward to plan it."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        return replace(share, setup_traces_step=True)


class PlanFromFile(Term):
    """``memory.plan: <file>``: the planned arena, loaded."""
