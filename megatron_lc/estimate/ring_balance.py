"""What packed documents and windows do to a ring layout: the slowest ring rank's share of the attention work and
the k/v rows it receives, for the time model (``time_estimate.py``) and the estimate's table.

The estimator has no micro-batch, only ``data.mean_document_length``: it lays out ``SAMPLES`` mock samples of that
length-weighted mean (``data/dataset.mock_document_ends``, the mock data's documents) with the functions the trainer
calls (``parallel/cp_balance.py``, ``attention/kv_plan.py``) and takes their mean. Per layer ``l`` (its window) and
ring rank ``r``: pairs ``P[l][r]`` and rows received ``N[l][r]``; each layer waits for its slowest rank, so

    imbalance = sum_l max_r P[l][r] / sum_l mean_r P[l][r]      (1 = balanced; the zigzag at 1M, cp 8, 64K: ~2)
    rows      = mean_l max_r N[l][r]                            (the zigzag ring: (R-1) s/R whatever the documents)

Without documents or a window the ring is the causal zigzag: imbalance 1, the whole ring's rows. Example, 1M tokens,
ring of 8, documents of a 64K mean: zigzag imbalance 1.98 and 917,504 rows; balanced 1.00 and ~220,000 rows (the
slowest receiver; ``bench/document_balance.py`` prints the same per case).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..attention.kv_plan import kv_plan
from ..config.documents import DocumentRanges
from ..data.dataset import mock_document_ends
from ..parallel.cp_balance import rank_work
from ..parallel.token_layout import ring_spans
from .dims import Dims

SAMPLES = 4  # mock samples averaged (seeds 0..3)


@dataclass(frozen=True)
class RingBalance:
    imbalance: float  # the slowest ring rank's attention pairs over the mean rank's, summed over the layers
    rows: float  # k/v rows the slowest receiver gets in one layer's forward (the mean over the layers)
    rank_tokens: int  # s/R, a ring rank's tokens
    ring: int  # R
    # the balanced exchange's buffers, per mock sample: for every rank r and step i, (rows in use: received from
    # r-i, rows in flight ahead: step i+1's received and sent, rows on their way back: step i-1's grads sent and
    # received), each over s/R -- what ``attention_kernels._exchange_backward`` holds at block i
    steps: tuple = ()

    @property
    def ring_rows(self) -> int:
        """What the zigzag ring moves to every rank: (R-1) s/R."""
        return (self.ring - 1) * self.rank_tokens


def mock_documents(seq_length: int, mean: int, seed: int) -> DocumentRanges:
    """One mock sample's documents (the mock data's lengths; ``seed`` as the sample)."""
    ends = mock_document_ends(np.random.default_rng([seed, seq_length]), seq_length, mean) + 1  # EOD ends its doc
    return DocumentRanges(((0, *(int(e) for e in ends if e < seq_length), seq_length),))


@functools.lru_cache(maxsize=64)
def _balance(s: int, R: int, doc_length: int, balanced: bool, balance_window: Optional[int],
             windows: tuple) -> RingBalance:
    slow = mean = rows = 0.0
    steps = []
    layers = {w: windows.count(w) for w in windows}  # each distinct window once, weighted by its layers
    for seed in range(SAMPLES if doc_length else 1):
        docs = mock_documents(s, doc_length, seed) if doc_length else None
        spans = ring_spans(balanced, balance_window, docs, s, R)
        for w, n in layers.items():
            pairs = np.array(rank_work(docs, s, spans, w), dtype=np.float64)
            slow, mean = slow + n * pairs.max(), mean + n * pairs.mean()
            if balanced and (docs is not None or w is not None):
                plan = kv_plan(docs, w, spans, s)
                rows += n * max(plan.received_rows(r) for r in range(R))
                steps.append(_step_buffers(plan, R, s // R))
            else:
                rows += n * (R - 1) * (s // R)
    k = (SAMPLES if doc_length else 1) * len(windows)
    return RingBalance(slow / mean, rows / k, s // R, R, tuple(steps))


def _step_buffers(plan, R: int, T: int) -> tuple:
    """``RingBalance.steps`` of one plan: (in use, ahead, back) over ``T`` for every rank and step."""
    def got(r, i):  # rows r receives at step i
        return plan.count(r, (r - i) % R) if 0 < i < R else 0

    def sent(r, i):  # rows r sends at step i
        return plan.count((r + i) % R, r) if 0 < i < R else 0
    return tuple(sorted({(got(r, i) / T, (got(r, i + 1) + sent(r, i + 1)) / T, (got(r, i - 1) + sent(r, i - 1)) / T)
                         for r in range(R) for i in range(1, R)}))


def ring_balance(dims: Dims) -> Optional[RingBalance]:
    """The layout's ``RingBalance`` (module doc), None without a ring."""
    ring = dims.cp // (dims.ulysses if dims.uses_a2a else 1)
    if ring == 1 or dims.cp_comm_type not in ("p2p", "a2a+p2p"):
        return None
    if not dims.ranges:  # one causal sequence: the zigzag
        T = dims.seq_length // ring
        return RingBalance(1.0, float((ring - 1) * T), T, ring)
    return _balance(dims.seq_length, ring, min(dims.doc_length, dims.seq_length), dims.cp_layout == "balanced",
                    dims.balance_window, tuple(dims.windows or (None,)))


__all__ = ["RingBalance", "mock_documents", "ring_balance"]
