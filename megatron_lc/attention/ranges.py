"""Masks as ranges: a block of queries x keys under document masks and a causal sliding window, cut into rectangles
the kernels run without any mask. Computed on the host from Python integers (``config.DocumentRanges`` and the
block's global positions), once per micro-batch and block (cached), never from device values.

Visibility, in global positions: query i sees key j when both are in the same document, ``j <= i`` and, with a
window W (Mistral's / Hugging Face's ``sliding_window``), ``j > i - W``. A block is given as spans
``(global start, global end, local start)`` of its queries and of its keys (a ring rank's two zigzag chunks, a
gathered FPDT chunk, a whole sequence). Each (query span, key span, document) region is cut into rectangles of
three kinds, in local rows of the block's tensors:

    FULL    every query sees every key (the kernel with no mask, ``causal=False``)
    CAUSAL  square, same global start: query p sees keys 0..p (the kernel's ``causal=True``)
    ANTI    square: query p sees keys p..m-1 (both reversed it is CAUSAL: run as such, no mask)

Queries no rectangle covers see no key of the block (out 0, lse -inf: the merge ignores them); a block without
rectangles is skipped. Example, 8 tokens, documents ``0 0 0 1 1 2 2 2``, ring of 2 (rank 0 holds tokens 0 1 | 6 7,
rank 1 tokens 2 3 | 4 5; local rows in brackets)::

    rank 0, own k/v:     CAUSAL q 0-1 [0,2) x k 0-1 [0,2); CAUSAL q 6-7 [2,4) x k 6-7 [2,4)
    rank 0, rank 1's:    FULL q 6-7 [2,4) x k 5 [3,4)                       (document 2)
    rank 1, own k/v:     CAUSAL q 2 [0,1) x k 2; CAUSAL q 3-4 [1,3) x k 3-4; CAUSAL q 5 [3,4) x k 5
    rank 1, rank 0's:    FULL q 2 [0,1) x k 0-1 [0,2)                       (document 0; queries 3-5 see none)

With a window W = 2 and no documents, 6 tokens in one block: CAUSAL [0,2)x[0,2), ANTI [2,3)x[1,2), CAUSAL
[2,4)x[2,4), ANTI [4,5)x[3,4), CAUSAL [4,6)x[4,6) -- the band, O(s*W) pairs, never an s x s tensor.
"""
from __future__ import annotations

import bisect
import functools
from typing import NamedTuple, Optional

from ..config.documents import DocumentRanges

FULL, CAUSAL, ANTI = "full", "causal", "anti"


class Rect(NamedTuple):
    """One rectangle of a block: ``row`` the batch row (None: every row, no documents), local rows ``[q0, q1)`` of
    the queries and ``[k0, k1)`` of the keys."""

    kind: str
    row: Optional[int]
    q0: int
    q1: int
    k0: int
    k1: int


class Rects(tuple):
    """A block's rectangles (a tuple of ``Rect``), cached with the micro-batch's ranges; ``packed`` keeps what a
    kernel derives from them once (``fused_cuda.py``: its calls' host index arrays), so the layers reuse it."""

    def __new__(cls, items=()):
        out = super().__new__(cls, items)
        out.packed = {}
        return out


def _band(qa: int, qb: int, ka: int, kb: int, w: Optional[int]):
    """(kind, q start, q end, k start, k end) in global positions covering exactly the visible pairs of queries
    ``[qa, qb)`` and keys ``[ka, kb)`` of one document. Query i sees ``[max(ka, i-W+1), min(kb-1, i)]``; the left
    edge is constant before ``i = ka + W`` and diagonal after, the right edge diagonal before ``i = kb`` and constant
    after, so the queries split into at most three zones, each a fixed pattern of FULL / CAUSAL / ANTI pieces."""
    qa = max(qa, ka)  # earlier queries precede every key
    if w is not None:
        qb = min(qb, kb - 1 + w)  # later queries are past every key's window
    if qa >= qb:
        return
    cuts = sorted({qa, qb} | {p for p in ((ka + w) if w is not None else None, kb) if p is not None and qa < p < qb})
    for a, b in zip(cuts, cuts[1:]):
        left_diag = w is not None and a >= ka + w
        right_diag = b <= kb
        if not left_diag and right_diag:  # keys [ka, i]: the ones before a to all, then the causal square
            if ka < a:
                yield FULL, a, b, ka, a
            yield CAUSAL, a, b, a, b
        elif not left_diag:  # keys [ka, kb): all of them
            yield FULL, a, b, ka, kb
        elif not right_diag:  # keys [i-W+1, kb): an anti-causal square, then the keys every query sees
            yield ANTI, a, b, a - w + 1, b - w + 1
            if b - w + 1 < kb:
                yield FULL, a, b, b - w + 1, kb
        else:  # the band [i-W+1, i], in tiles of W queries
            for t in range(a, b, w):
                e = min(t + w, b)
                if e - 1 > t:
                    yield ANTI, t, e - 1, t - w + 1, e - w
                if e - w < t:
                    yield FULL, t, e, e - w, t
                yield CAUSAL, t, e, t, e


def _documents(cu: Optional[tuple], lo: int, hi: int):
    """(clipped start, clipped end, document start, document end) of the documents meeting ``[lo, hi)``; without
    documents the whole range is one."""
    if cu is None:
        yield lo, hi, lo, hi
        return
    k = bisect.bisect_right(cu, lo) - 1
    while k + 1 < len(cu) and cu[k] < hi:
        yield max(cu[k], lo), min(cu[k + 1], hi), cu[k], cu[k + 1]
        k += 1


def _rects(cu: Optional[tuple], row: Optional[int], window: Optional[int], q_spans: tuple, k_spans: tuple) -> list:
    """The rectangles of one batch row (``cu``: its document offsets, None without documents)."""
    out = []
    for qg0, qg1, ql in q_spans:
        for kg0, kg1, kl in k_spans:
            if kg0 >= qg1 or (window is not None and kg1 - 1 + window <= qg0):
                continue  # keys all after the queries, or all before their windows
            for d0, d1, ds, de in _documents(cu, max(qg0, kg0), qg1):
                if cu is None:
                    ds, de = kg0, kg1
                ka, kb = max(kg0, ds), min(kg1, de)  # this document's keys in the key span
                if ka >= kb:
                    continue
                for kind, a, b, c, d in _band(d0, d1, ka, kb, window):
                    out.append(Rect(kind, row, a - qg0 + ql, b - qg0 + ql, c - kg0 + kl, d - kg0 + kl))
    return out


@functools.lru_cache(maxsize=256)
def _plain_rects(window: Optional[int], q_spans: tuple, k_spans: tuple) -> Rects:
    return Rects(_rects(None, None, window, q_spans, k_spans))


def block_rects(documents: Optional[DocumentRanges], window: Optional[int], q_spans: tuple,
                k_spans: tuple) -> Optional[tuple]:
    """The rectangles of a block (see the module doc); None when neither documents nor a window restrict it (the
    caller's plain causal / full kernel call). ``q_spans`` / ``k_spans``: tuples of ``(global start, global end,
    local start)``."""
    if documents is None and window is None:
        return None
    q_spans, k_spans = _joined(q_spans), _joined(k_spans)
    if documents is None:
        return _plain_rects(window, q_spans, k_spans)
    return documents.cached(("rects", window, q_spans, k_spans), lambda: Rects(
        r for row, cu in enumerate(documents.cu) for r in _rects(cu, row, window, q_spans, k_spans)))


def rect_pairs(rects, rows: int) -> int:
    """The (query, key) pairs ``rects`` run for each head (``rows``: the batch's, for rectangles of every row):
    FULL ``m x n``, CAUSAL and ANTI squares ``m (m + 1) / 2``; kept with the rectangles."""
    if rects is None:
        return 0
    key = ("pairs", rows)
    if key not in rects.packed:
        rects.packed[key] = sum((r.q1 - r.q0) * (r.k1 - r.k0 if r.kind == FULL else r.q1 - r.q0 + 1)
                                // (1 if r.kind == FULL else 2) * (rows if r.row is None else 1) for r in rects)
    return rects.packed[key]


def _joined(sp: tuple) -> tuple:
    """Spans with the ones that continue each other (globally and locally) joined: fewer, larger rectangles."""
    out = []
    for g0, g1, l0 in sp:
        if out and out[-1][1] == g0 and out[-1][2] + out[-1][1] - out[-1][0] == l0:
            out[-1] = (out[-1][0], g1, out[-1][2])
        else:
            out.append((g0, g1, l0))
    return tuple(out)


def spans(globals_: list, local_start: int = 0) -> tuple:
    """Spans of consecutive global ranges laid out one after the other from ``local_start``: ``[(g0, g1), ...]``
    -> ``((g0, g1, l0), ...)``. Example, ring rank 0 of 2 over 8 tokens: ``[(0, 2), (6, 8)]`` ->
    ``((0, 2, 0), (6, 8, 2))``."""
    out, at = [], local_start
    for g0, g1 in globals_:
        out.append((g0, g1, at))
        at += g1 - g0
    return tuple(out)


__all__ = ["ANTI", "CAUSAL", "FULL", "Rect", "Rects", "block_rects", "rect_pairs", "spans"]
