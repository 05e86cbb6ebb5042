"""Selective recompute (``memory/recompute.SelectiveExecutor``, ``recompute_granularity: selective``): the core
attention runs under a torch checkpoint, so its forward runs again in the layer's backward.

Memory: with flash-style kernels the attention keeps only q, k, v, out and lse, which the checkpoint keeps too, so a
layer keeps what the plain one keeps. Example, Llama3-8B at 1M tokens on 8 H100s (tp 1, ring cp 8): attention is 95%
of a layer's forward FLOPs there, so the recompute is 62.9 s a step, nearly the whole forward's 63.6 s.
"""
from __future__ import annotations

from dataclasses import replace

from .term import LayerSeconds, MemoryShare, Run, Term, TimeShare


class SelectiveRecompute(Term):
    """``recompute_granularity: selective`` (see the module doc)."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        return replace(share, kept=share.full)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        return replace(share, recompute=share.recompute + seconds.attention_fwd)
