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

from ..config import Layout
from ..config.documents import DocumentRanges, union
from ..parallel.cp_balance import rank_work
from ..parallel.token_layout import local_token_index, ring_spans
from ..parallel.topology import Topology
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


def _joined(index) -> list:
    """Positions -> ``[[start, end], ...]`` of their runs, in order."""
    out = []
    for t in index.tolist():
        if out and out[-1][1] == t:
            out[-1][1] += 1
        else:
            out.append([t, t + 1])
    return out


def cp_rank_figures(layout: Layout, documents: Optional[DocumentRanges], head_dim: int, element_bytes: int) -> list:
    """Per cp rank, in cp-rank order, what the trainer's layout gives it for a micro-batch of ``documents``:
    ``tokens`` (its global ranges in local order: ``token_layout.local_token_index``), ``pairs`` (the (query, key)
    pairs its attention runs for each of its heads: its ring rank's queries, the whole sequence under Ulysses /
    FPDT) and ``kv_received_bytes_per_layer`` (the k/v its ring attention receives in one layer's forward: the
    plan's rows under the balanced layout, every other ring rank's tokens under the zigzag, 0 without a ring), each
    the mean over the layers' windows. ``documents`` None: one causal sequence a row (``layout.micro_batch_size``
    rows)."""
    s, R, U = layout.seq_length, layout.ring, layout.ulysses
    rows = documents.rows if documents is not None else layout.micro_batch_size
    kv_heads = layout.kv_heads * layout.kv_replication // U  # per rank after the Ulysses head scatter
    row_bytes = 2 * rows * kv_heads * head_dim * element_bytes
    balanced = layout.cp_layout == "balanced"
    spans = ring_spans(balanced, layout.balance_window, documents, s, R)
    windows = layout.windows or (None,)
    pairs, received = [0.0] * R, [0.0] * R
    for w in set(windows):  # each distinct window once, weighted by its layers
        share = windows.count(w) / len(windows)
        for r, n in enumerate(rank_work(documents, s, spans, w)):
            pairs[r] += n * share
        if R > 1 and balanced and (documents is not None or w is not None):
            plan = kv_plan(documents, w, spans, s)
            for r in range(R):
                received[r] += plan.received_rows(r) * row_bytes * share
        elif R > 1:  # the ring: every other ring rank's tokens (the balanced layout without documents or window too)
            for r in range(R):
                received[r] += (R - 1) * (s // R) * row_bytes * share
    out = []
    for c in range(layout.cp):
        topo = Topology(world_size=layout.cp, rank=c, cp=layout.cp, ulysses=U)
        out.append({"tokens": _joined(local_token_index(layout, topo, s, documents)), "pairs": int(pairs[c // U]),
                    "kv_received_bytes_per_layer": int(received[c // U])})
    return out


__all__ = ["KvPlan", "cp_rank_figures", "kv_plan"]
