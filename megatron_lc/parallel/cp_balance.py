"""The balanced ring layout (``parallel.cp_layout: balanced``): which global tokens each ring rank holds so that
every rank runs the same attention work under packed documents and a sliding window. Host integers from the
micro-batch's ``DocumentRanges``, deterministic, so every rank computes the same layout without a collective.

**Work.** Under document masks query ``i`` sees the earlier keys of its own document (at most ``W`` with a window):
``min(i - start + 1, W)`` (query, key) pairs, whichever rank holds it -- the keys it lacks are sent to it
(``attention/kv_plan.py``). So a rank's attention work is the sum of its queries' (``DocumentRanges.token_work``)
and balancing is a partition of the ``s`` tokens into ``R`` sets of exactly ``s/R`` with equal sums. Where a token
sits changes only the traffic: a document kept on one rank moves none of its k/v.

**The solver** (O(s) numpy, no search):

1. The documents (with several batch rows: the pieces between any row's boundaries) are ordered by work per token,
   heaviest first, ties by position; a document longer than a rank's share ``s/R`` in head-tail order ``a, b-1,
   a+1, b-2, ...`` (every pair ``(a+k, b-1-k)`` of a causal document runs ``L + 1`` pairs, so any run of that order
   has the document's mean work per token), a shorter one in its own order (cut once, it leaves two contiguous
   pieces: fewer rectangles). This concatenation is the *material*.
2. Rank ``r`` in turn takes ``h`` tokens from the heavy end of the material left and ``s/R - h`` from the light end,
   ``h`` chosen so that its work is closest to the mean of what is left per rank left (ties: the larger ``h``).
   The heavy end splits the long documents head-and-tail over consecutive ranks; the light end hands the short
   ones out whole (one document at most is cut at each rank's light edge).
3. A rank's tokens sorted by position and joined into spans: its local order.

One causal document (no masks) is the zigzag: every ``h`` gives the same work, the largest is taken, and rank ``r``
gets chunks ``r`` and ``2R-1-r``. Example, 16 tokens in documents of 10, 3 and 3 tokens (work 55, 6, 6), R = 2::

    material   doc 0 (10 > 8 tokens) head-tail: 0 9 1 8 2 7 3 6 4 5 | doc 1: 10 11 12 | doc 2: 13 14 15
    rank 0     h = 5 (0 9 1 8 2: 25 pairs) + 3 light (13 14 15: 6 pairs) -> spans (0, 3) (8, 10) (13, 16), 31 pairs
    rank 1     the rest: (3, 8) (10, 13), 36 pairs         (target 33.5; the zigzag: 19 and 48 pairs, 1.43x the mean)

(single tokens: h = 6 would give 38; at full scale a token's work is far below a rank's, and
``bench/document_balance.py`` prints slowest / mean = 1.00).
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from ..config.documents import DocumentRanges

Spans = tuple  # per ring rank, a tuple of (global start, global end) in local order


def zigzag_spans(seq_length: int, R: int) -> Spans:
    """Chunks ``r`` and ``2R-1-r`` of ``2R`` equal chunks for ring rank ``r`` (one span each; the whole sequence when
    ``R == 1``). Example, s = 8, R = 2: ``(((0, 2), (6, 8)), ((2, 4), (4, 6)))``."""
    if R == 1:
        return (((0, seq_length),),)
    c = seq_length // (2 * R)
    return tuple(((r * c, (r + 1) * c), ((2 * R - 1 - r) * c, (2 * R - r) * c)) for r in range(R))


def _pieces(documents: DocumentRanges) -> np.ndarray:
    """Boundaries of the pieces no row's document boundary cuts (one row: its documents)."""
    return np.unique(np.concatenate([np.asarray(c, dtype=np.int64) for c in documents.cu]))


def _material(cuts: np.ndarray, work: np.ndarray, share: int) -> np.ndarray:
    """The tokens in material order (module doc, step 1): documents longer than a rank's ``share`` head-tail,
    the others in their own order (one cut leaves two contiguous pieces: fewer rectangles)."""
    starts, ends = cuts[:-1], cuts[1:]
    csum = np.concatenate([[0], np.cumsum(work)])
    density = (csum[ends] - csum[starts]) / (ends - starts)
    order = np.lexsort((starts, -density))  # heaviest first, then by position
    out, at = np.empty(int(cuts[-1]), dtype=np.int64), 0
    for k in order:
        a, b = int(starts[k]), int(ends[k])
        n = b - a
        if n <= share:
            out[at:at + n] = np.arange(a, b)
        else:
            out[at:at + n:2] = a + np.arange((n + 1) // 2)  # head
            out[at + 1:at + n:2] = b - 1 - np.arange(n // 2)  # tail
        at += n
    return out


def _as_spans(tokens: np.ndarray) -> tuple:
    """Sorted global positions -> joined ``(start, end)`` spans."""
    tokens = np.sort(tokens)
    breaks = np.flatnonzero(np.diff(tokens) != 1) + 1
    starts, ends = tokens[np.concatenate([[0], breaks])], tokens[np.concatenate([breaks - 1, [len(tokens) - 1]])] + 1
    return tuple((int(a), int(b)) for a, b in zip(starts, ends))


def solve(work: np.ndarray, cuts: np.ndarray, R: int) -> Spans:
    """Each ring rank's spans for per-token ``work`` over pieces ``cuts`` (module doc, steps 1-3)."""
    s = len(work)
    T = s // R
    order = _material(cuts, work, T)
    prefix = np.concatenate([[0], np.cumsum(work[order])])
    heavy, light, out = 0, s, []
    for r in range(R):
        h = T
        if r < R - 1:
            hs = np.arange(T + 1)
            got = (prefix[heavy + hs] - prefix[heavy]) + (prefix[light] - prefix[light - T + hs])
            target = (prefix[light] - prefix[heavy]) / (R - r)
            h = T - int(np.argmin(np.abs(got - target)[::-1]))  # the closest; ties: the largest h
        out.append(_as_spans(np.concatenate([order[heavy:heavy + h], order[light - (T - h):light]])))
        heavy, light = heavy + h, light - (T - h)
    return tuple(out)


@functools.lru_cache(maxsize=16)
def _window_only(seq_length: int, R: int, window: int) -> Spans:
    whole = DocumentRanges(((0, seq_length),))
    return solve(whole.token_work(window), np.array([0, seq_length]), R)


def balanced_spans(documents: Optional[DocumentRanges], seq_length: int, R: int, window: Optional[int]) -> Spans:
    """The balanced layout of a micro-batch (cached with its ranges): each ring rank's spans in local order. Without
    documents and window it is the zigzag."""
    if R == 1:
        return zigzag_spans(seq_length, 1)
    if documents is None:
        return zigzag_spans(seq_length, R) if window is None else _window_only(seq_length, R, window)
    return documents.cached(("balanced_spans", R, window),
                            lambda: solve(documents.token_work(window), _pieces(documents), R))


def rank_work(documents: Optional[DocumentRanges], seq_length: int, spans: Spans,
              window: Optional[int]) -> list[int]:
    """The (query, key) pairs each ring rank's attention runs under ``spans`` (``token_work`` summed over its
    tokens)."""
    docs = documents if documents is not None else DocumentRanges(((0, seq_length),))
    csum = docs.cached(("work_prefix", window), lambda: np.concatenate([[0], np.cumsum(docs.token_work(window))]))
    return [int(sum(csum[b] - csum[a] for a, b in rank)) for rank in spans]


__all__ = ["Spans", "balanced_spans", "rank_work", "solve", "zigzag_spans"]
