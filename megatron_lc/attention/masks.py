"""How much of the attention document masks and sliding windows leave: the (query, key) pairs MFU counts
(``training/metrics.py``), from the host's document ranges (``config.DocumentRanges``) and the layers' windows --
no mask is ever built (``ranges.py`` cuts blocks into rectangles instead).

Pairs are counted as the model-FLOPs formula counts a causal sample (``s^2 / 2``): a document of L tokens is
``L^2 / 2``, and under a window W each query sees at most W keys (``W^2 / 2 + (L - W) * W`` when ``L > W``). Layers
may differ (Gemma's alternating local / global layers), so the count is the mean over layers. Example: one row of
8 tokens, documents of 3, 2 and 3 tokens, two layers, one with a window of 2::

    attended_pairs(DocumentRanges(((0, 3, 5, 8),)), (2, None), 8)
    = ((2 + 2) + 2 + (2 + 2)  +  (4.5 + 2 + 4.5)) / 2 = (10 + 11) / 2 = 10.5
"""
from __future__ import annotations

from typing import Optional, Sequence

from ..config.documents import DocumentRanges, window_pairs


def attended_pairs(documents: Optional[DocumentRanges], windows: Sequence[Optional[int]], seq_length: int,
                   rows: int = 1) -> float:
    """Attended pairs of a micro-batch (``rows`` samples of ``seq_length`` tokens), the mean over layers of
    ``windows`` (None: no window); without documents every sample is one document."""
    windows = list(windows) or [None]
    if documents is None:
        return rows * sum(window_pairs(seq_length, w) for w in windows) / len(windows)
    return sum(documents.attended_pairs(w) for w in windows) / len(windows)
