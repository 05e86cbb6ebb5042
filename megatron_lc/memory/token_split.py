"""Which rows of a layer's tensors are "kept" and which are "dropped" (the Memo paper's token-wise split, section
4.1): used by token-wise recompute / Memo (``memo/steps.py``: kept tokens saved, dropped ones recomputed) and by the
whole-layer re-run in mini-sequences (``chunked_layer.py``: every token "dropped", its rows selected per chunk).

Of S local tokens the first ``sA`` are kept, the other ``sD = S - sA`` dropped. With Megatron sequence parallelism
(tp = G > 1) ``pre`` all-gathers over tp, so its outputs hold G blocks of S tokens, rank order: kept tokens of such a
tensor are rows ``[g*S, g*S + sA)`` of every block g. Example S = 4, sA = 1, G = 2 (rank r holds tokens r0..r3)::

    local x on rank r     [r0 r1 r2 r3]              -> kept [r0]        dropped [r1 r2 r3]
    gathered q            [00 01 02 03 10 11 12 13]  -> kept [00 10]     dropped [01 02 03 11 12 13]

Mini-sequences of c = 2 dropped tokens: chunk 1 is local ``[r1 r2]`` / gathered ``[01 02 11 12]``, chunk 2 local
``[r3]`` / gathered ``[03 13]``.
"""
from __future__ import annotations

from typing import Optional

import torch


class TokenSplit:
    """The first ``sA`` of ``S`` local tokens kept, the rest dropped; gathered tensors have ``G`` blocks of S."""

    def __init__(self, S: int, sA: int, G: int):
        self.S, self.sA, self.sD, self.G = S, sA, S - sA, G

    def local(self, t: torch.Tensor):
        return t[:self.sA], t[self.sA:]

    def gathered(self, t: torch.Tensor):
        """A tensor over the G*S gathered tokens -> (kept rows, dropped rows), each in block order."""
        if self.G == 1:
            return t[:self.sA], t[self.sA:]
        v = t.view(self.G, self.S, *t.shape[1:])
        return (v[:, :self.sA].reshape(self.G * self.sA, *t.shape[1:]),
                v[:, self.sA:].reshape(self.G * self.sD, *t.shape[1:]))

    def dropped_chunks(self, chunk: Optional[int]) -> list:
        """``[(start, end)]`` mini-sequences of the dropped tokens (local rows ``[sA + start, sA + end)``), at most
        ``chunk`` each; one range when ``chunk`` is None."""
        c = chunk or self.sD
        return [(i, min(i + c, self.sD)) for i in range(0, self.sD, c)]

    def dropped_rows(self, t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Rows ``[start, end)`` of every one of the G blocks of a gathered dropped-token tensor (block order)."""
        if self.G == 1:
            return t[start:end]
        return t.view(self.G, self.sD, *t.shape[1:])[:, start:end].reshape(self.G * (end - start), *t.shape[1:])

    def merge(self, a: Optional[torch.Tensor], d: Optional[torch.Tensor]) -> torch.Tensor:
        """Inverse of ``gathered``."""
        if a is None or self.sA == 0:
            return d
        if d is None or self.sD == 0:
            return a
        if self.G == 1:
            return torch.cat([a, d])
        rest = a.shape[1:]
        return torch.cat([a.view(self.G, self.sA, *rest), d.view(self.G, self.sD, *rest)], 1).view(-1, *rest)
