"""Which rows of a layer's tensors are "kept" and which are "dropped" (the Memo paper's token-wise split, section
4.1): used by token-wise recompute / Memo (``memo/steps.py``: kept tokens saved, dropped ones recomputed) and by the
whole-layer re-run in mini-sequences (``chunked_layer.py``: every token "dropped", its rows selected per chunk).

Of ``tokens`` local tokens the first ``kept`` are kept, the other ``dropped = tokens - kept`` dropped. With Megatron
sequence parallelism (tp = ``blocks`` > 1) ``pre`` all-gathers over tp, so its outputs hold ``blocks`` blocks of
``tokens`` rows, rank order: kept tokens of such a tensor are rows ``[g * tokens, g * tokens + kept)`` of every block
g. Example tokens = 4, kept = 1, blocks = 2 (rank r holds tokens r0..r3)::

    local x on rank r     [r0 r1 r2 r3]              -> kept [r0]        dropped [r1 r2 r3]
    gathered q            [00 01 02 03 10 11 12 13]  -> kept [00 10]     dropped [01 02 03 11 12 13]

Mini-sequences of c = 2 dropped tokens: chunk 1 is local ``[r1 r2]`` / gathered ``[01 02 11 12]``, chunk 2 local
``[r3]`` / gathered ``[03 13]``.
"""
from __future__ import annotations

from typing import Optional

import torch


class TokenSplit:
    """The first ``kept`` of ``tokens`` local tokens kept, the rest dropped; gathered tensors have ``blocks`` blocks of
    ``tokens`` rows."""

    def __init__(self, tokens: int, kept: int, blocks: int):
        self.tokens, self.kept, self.dropped, self.blocks = tokens, kept, tokens - kept, blocks

    def local(self, t: torch.Tensor):
        return t[:self.kept], t[self.kept:]

    def gathered(self, t: torch.Tensor):
        """A tensor over the ``blocks * tokens`` gathered tokens -> (kept rows, dropped rows), each in block order."""
        if self.blocks == 1:
            return t[:self.kept], t[self.kept:]
        v = t.view(self.blocks, self.tokens, *t.shape[1:])
        return (v[:, :self.kept].reshape(self.blocks * self.kept, *t.shape[1:]),
                v[:, self.kept:].reshape(self.blocks * self.dropped, *t.shape[1:]))

    def dropped_chunks(self, chunk: Optional[int]) -> list:
        """``[(start, end)]`` mini-sequences of the dropped tokens (local rows ``[kept + start, kept + end)``), at most
        ``chunk`` each; one range when ``chunk`` is None."""
        c = chunk or self.dropped
        return [(i, min(i + c, self.dropped)) for i in range(0, self.dropped, c)]

    def dropped_rows(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of every one of the ``blocks`` blocks of a gathered dropped-token tensor (block
        order)."""
        if self.blocks == 1:
            return t[start:end]
        rows = t.view(self.blocks, self.dropped, *t.shape[1:])[:, start:end]
        return rows.reshape(self.blocks * (end - start), *t.shape[1:])

    def merge(self, a: Optional[torch.Tensor], d: Optional[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``gathered``."""
        if a is None or self.kept == 0:
            return d
        if d is None or self.dropped == 0:
            return a
        if self.blocks == 1:
            return torch.cat([a, d])
        rest = a.shape[1:]
        blocks = self.blocks
        return torch.cat([a.view(blocks, self.kept, *rest), d.view(blocks, self.dropped, *rest)], 1).view(-1, *rest)
