"""Where the packed documents of a micro-batch start and end: host integers, computed once per micro-batch from the
data (``data/dataset.make_batch``), never from device tensors, and handed to every core attention as they are.

A row's documents are its ``cu`` offsets (``cu_seqlens`` in the kernels' name): document k is tokens
``[cu[k], cu[k+1])``. Example, a row of 8 tokens with documents ``0 0 0 1 1 2 2 2``::

    DocumentRanges(((0, 3, 5, 8),))
    .within(0, 2, 6)   -> [(2, 3), (3, 5), (5, 6)]      documents clipped to global positions [2, 6)
    .ids()             -> tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    .attended_pairs()  -> 3^2/2 + 2^2/2 + 3^2/2 = 11.0  (the model-FLOPs count of ``training/metrics.py``)
    .token_work()      -> [1, 2, 3, 1, 2, 1, 2, 3]      keys each query sees (its position in its document + 1)
    .keys_seen(4, 6)   -> [(3, 6)]                      the keys queries 4-5 see: their documents' up to query 5

The attention turns a block's global query and key positions and these offsets into rectangles
(``attention/ranges.py``); the cut is cached here, per block and window, so every layer of the micro-batch and its
backward reuse it. The object lives in ``config/`` because both the data (which builds it) and the attention (which
reads it) may import from here.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


def window_pairs(length: int, window: Optional[int]) -> float:
    """Attended (query, key) pairs of one document counted as the causal FLOPs formula counts a sequence (``L^2/2``),
    each query seeing at most ``window`` keys: ``L^2/2`` when ``L <= W``, else ``W^2/2 + (L - W) * W``."""
    if window is None or length <= window:
        return length * length / 2
    return window * window / 2 + (length - window) * window


def union(ranges) -> list[tuple[int, int]]:
    """Sorted disjoint ``[a, b)`` ranges covering the given ones (touching ranges joined).
    Example: ``[(5, 7), (0, 2), (1, 3), (3, 4)]`` -> ``[(0, 4), (5, 7)]``."""
    out = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class DocumentRanges:
    """Document offsets per batch row (see the module doc). ``cu[row]`` starts at 0 and ends at the row's length;
    every row has the same length."""

    cu: tuple
    cache: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        s = self.cu[0][-1]
        for c in self.cu:
            if c[0] != 0 or c[-1] != s or any(b <= a for a, b in zip(c, c[1:])):
                raise ValueError(f"document offsets {c} must rise strictly from 0 to the row length {s}")

    @classmethod
    def from_ids(cls, ids) -> "DocumentRanges":
        """From non-decreasing document ids ``[b, s]`` (a host array or CPU tensor), e.g. ``document_fields``'."""
        ids = np.asarray(ids)
        rows = []
        for r in ids:
            starts = np.flatnonzero(r[1:] != r[:-1]) + 1
            rows.append((0, *(int(x) for x in starts), int(r.shape[0])))
        return cls(tuple(rows))

    @classmethod
    def from_eod(cls, tokens: np.ndarray, eod: int) -> "DocumentRanges":
        """From token ids ``[b, s]`` where ``eod`` ends a document (the EOD belongs to the document it ends)."""
        rows = []
        for r in np.asarray(tokens):
            ends = np.flatnonzero(r[:-1] == eod) + 1
            rows.append((0, *(int(x) for x in ends), int(r.shape[0])))
        return cls(tuple(rows))

    @property
    def rows(self) -> int:
        return len(self.cu)

    @property
    def seq_length(self) -> int:
        return self.cu[0][-1]

    def to(self, *_, **__) -> "DocumentRanges":
        """Host data by design: moving a batch to its device leaves the ranges where they are."""
        return self

    def lengths(self, row: int) -> list[int]:
        c = self.cu[row]
        return [b - a for a, b in zip(c, c[1:])]

    def within(self, row: int, lo: int, hi: int) -> list[tuple[int, int]]:
        """The documents of ``row`` clipped to global positions ``[lo, hi)``, in order."""
        c = self.cu[row]
        k = bisect.bisect_right(c, lo) - 1
        out = []
        while k + 1 < len(c) and c[k] < hi:
            out.append((max(c[k], lo), min(c[k + 1], hi)))
            k += 1
        return out

    def ids(self) -> torch.Tensor:
        """Document index of every token, ``[b, s]`` int64 (host)."""
        return torch.tensor(np.stack([np.repeat(np.arange(len(c) - 1), np.diff(c)) for c in self.cu]))

    def attended_pairs(self, window: Optional[int] = None) -> float:
        """Attended (query, key) pairs of the batch, counted as ``window_pairs`` counts one document."""
        return float(sum(window_pairs(n, window) for r in range(self.rows) for n in self.lengths(r)))

    def token_work(self, window: Optional[int] = None) -> np.ndarray:
        """Keys each query sees, summed over the rows, ``[s]`` int64: its position in its document + 1, at most
        ``window`` -- the (query, key) pairs its attention runs wherever its keys are (``parallel/cp_balance.py``
        balances the cp ranks by it)."""
        s = self.seq_length
        out = np.zeros(s, dtype=np.int64)
        for c in self.cu:
            c = np.asarray(c, dtype=np.int64)
            w = np.arange(s, dtype=np.int64) - np.repeat(c[:-1], np.diff(c)) + 1
            out += w if window is None else np.minimum(w, window)
        return out

    def keys_seen(self, lo: int, hi: int, window: Optional[int] = None) -> list[tuple[int, int]]:
        """The keys some query of ``[lo, hi)`` sees in some row, as sorted disjoint ranges: in each document from
        its start (or the window's, ``W - 1`` keys before the first query) to the last query."""
        ranges = []
        for c in self.cu:
            k = bisect.bisect_right(c, lo) - 1
            while k + 1 < len(c) and c[k] < hi:
                q0, q1 = max(c[k], lo), min(c[k + 1], hi)
                ranges.append((c[k] if window is None else max(c[k], q0 - window + 1), q1))
                k += 1
        return union(ranges)

    def cached(self, key, make):
        """``make()`` once per micro-batch and ``key`` (a block's cut into rectangles: ``attention/ranges.py``)."""
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]


__all__ = ["DocumentRanges", "union", "window_pairs"]
