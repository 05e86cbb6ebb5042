"""Which k/v rows each ring rank needs from each other one: the sparse exchange of the balanced layout
(``parallel.cp_layout: balanced``), planned on the host from the micro-batch's documents, the layer's window and the
ring ranks' spans (``parallel/cp_balance.py``), the same on every rank.

Rank ``r`` needs the keys some query of its spans sees (``DocumentRanges.keys_seen``: in each document from its
start, or the window's, to the last query) that it does not hold; rank ``j`` sends the part of them it holds, in its
local order, and nothing else. The received rows are a block of their own: its spans (global start, global end,
row in the buffer) give its rectangles against ``r``'s queries (``ranges.block_rects``), exact as any block.
Example, 16 tokens in documents of 10, 3 and 3, R = 2, no window (the layout of ``cp_balance``'s example)::

    rank 0 holds (0, 3) (8, 10) (13, 16); its queries 8-9 see keys 0-9: it needs 3-7, held by rank 1 (local rows 0-4)
    rank 1 holds (3, 8) (10, 13); its queries 3-7 see keys 0-7: it needs 0-2 (rank 0's local rows 0-2)
    rank 0 receives 5 rows (buffer spans ((3, 8, 0),)), rank 1 receives 3 (((0, 3, 0),)): 8 of the 2 x 7 rows a
    ring would move (each rank's whole k/v to the other)

Bytes per layer and rank: ``rows received x 2 (k, v) x b x kv heads x head dim x element size``, forward; the
backward receives the same rows again and returns their fp32 dk/dv to the owner.
"""
from __future__ import annotations

import functools
from typing import Optional

from ..config.documents import DocumentRanges, union
from .ranges import block_rects, spans as laid_out


def _subtract(ranges: list, holes: list) -> list:
    """Sorted disjoint ``ranges`` minus sorted disjoint ``holes``."""
    out = []
    for a, b in ranges:
        for x, y in holes:
            if y <= a or x >= b:
                continue
            if x > a:
                out.append((a, x))
            a = max(a, y)
            if a >= b:
                break
        if a < b:
            out.append((a, b))
    return out


class KvPlan:
    """The exchange of one micro-batch and window over a ring of ``len(spans)`` ranks (see the module doc).

    ``local[j]``: rank j's spans as ``(g0, g1, local start)``; ``rows[r][j]``: j's local ``(start, end)`` rows that
    r receives from it (empty: nothing); ``received[r][j]``: the buffer's spans ``(g0, g1, buffer row)``."""

    def __init__(self, documents: Optional[DocumentRanges], window: Optional[int], spans: tuple, seq_length: int):
        self.documents, self.window, self.size = documents, window, len(spans)
        docs = documents if documents is not None else DocumentRanges(((0, seq_length),))
        self.local = [laid_out(list(sp)) for sp in spans]
        self.rows, self.received = [], []
        for r, sp in enumerate(spans):
            need = _subtract(union(x for a, b in sp for x in docs.keys_seen(a, b, window)), sorted(sp))
            rows_r, recv_r = [], []
            for j in range(self.size):
                rows, recv, at = [], [], 0
                for g0, g1, l0 in self.local[j] if j != r else ():
                    for x, y in need:
                        a, b = max(g0, x), min(g1, y)
                        if a < b:
                            rows.append((l0 + a - g0, l0 + b - g0))
                            recv.append((a, b, at))
                            at += b - a
                rows_r.append(tuple(rows))
                recv_r.append(tuple(recv))
            self.rows.append(rows_r)
            self.received.append(recv_r)

    def count(self, r: int, j: int) -> int:
        """Rows rank ``r`` receives from rank ``j``."""
        return sum(b - a for a, b in self.rows[r][j])

    def received_rows(self, r: int) -> int:
        """Rows rank ``r`` receives in one layer's forward, from every other rank."""
        return sum(self.count(r, j) for j in range(self.size))

    def own_rects(self, r: int):
        """Rank ``r``'s queries against its own keys."""
        return block_rects(self.documents, self.window, self.local[r], self.local[r])

    def recv_rects(self, r: int, j: int):
        """Rank ``r``'s queries against the rows received from ``j``."""
        return block_rects(self.documents, self.window, self.local[r], self.received[r][j])


@functools.lru_cache(maxsize=32)
def _plain_plan(window: Optional[int], spans: tuple, seq_length: int) -> KvPlan:
    return KvPlan(None, window, spans, seq_length)


def kv_plan(documents: Optional[DocumentRanges], window: Optional[int], spans: tuple, seq_length: int) -> KvPlan:
    """The plan of a micro-batch, window and layout, made once (cached with the micro-batch's ranges)."""
    if documents is None:
        return _plain_plan(window, spans, seq_length)
    return documents.cached(("kv_plan", window, spans), lambda: KvPlan(documents, window, spans, seq_length))


__all__ = ["KvPlan", "kv_plan"]
