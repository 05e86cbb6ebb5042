"""Document masks: a token sees only the tokens of its own document (``data.reset_attention_mask``).

Every core attention receives the *full-sequence* document ids ``[b, s]`` (``data/dataset.document_fields``: every
rank has the whole batch before it keeps its share, so nothing about documents is communicated) and selects the ids
of the tokens it holds -- local order for local attention, the zigzag part of any ring rank, a gathered FPDT chunk.
For a block of queries and keys the mask is ``same document`` (and, on a diagonal block, causal over global order:
documents are contiguous, so together they are the block-diagonal causal mask). A block whose queries and keys share
no document is skipped; a query row that sees no key of a block takes no part in that block (kernels: out 0, lse
-inf; ``backends.py``). Example, 8 tokens, documents ``0 0 0 1 1 2 2 2``, ring of 2: rank 0 holds chunks 0 and 3
(tokens 0 1 | 6 7, ids ``0 0 | 2 2``), rank 1 chunks 1 and 2 (tokens 2 3 | 4 5, ids ``0 1 | 1 2``). Rank 0's back
queries 6 7 see rank 1's key 5 only (document 2); rank 1's queries 2 3 see rank 0's front keys 0 1 only from token
2 (document 0), token 3 sees none of them (a blind row of that block)."""
from __future__ import annotations

from typing import Optional

import torch


def visible(doc_q: torch.Tensor, doc_k: torch.Tensor) -> torch.Tensor:
    """``[b, sq]``, ``[b, sk]`` document ids -> ``[b, 1, sq, sk]``, True where query and key share a document."""
    return (doc_q.unsqueeze(-1) == doc_k.unsqueeze(-2)).unsqueeze(1)


def with_causal(visible: torch.Tensor, causal: bool) -> torch.Tensor:
    """``visible [b, 1, sq, sk]`` and, for a diagonal block, the causal triangle."""
    if not causal:
        return visible
    sq, sk = visible.shape[-2:]
    return visible & torch.ones(sq, sk, dtype=torch.bool, device=visible.device).tril()


def select(documents: Optional[torch.Tensor], index: torch.Tensor) -> Optional[torch.Tensor]:
    """The document ids of global token positions ``index`` (None passes through: no document masks)."""
    if documents is None:
        return None
    return documents.index_select(1, index.to(documents.device))


def overlap(doc_q: torch.Tensor, doc_k: torch.Tensor) -> bool:
    """Whether any query of the block may see any key (ids are non-decreasing along the global sequence, so the
    ranges of the two blocks overlap exactly when some pair shares a document)."""
    return bool(((doc_q.min(1).values <= doc_k.max(1).values) & (doc_k.min(1).values <= doc_q.max(1).values)).any())


def attended_pairs(documents: torch.Tensor) -> float:
    """Causal (query, key) pairs of a batch's attention under its document masks, counted as the model-FLOPs
    formula counts a sample (``s^2 / 2``, ``training/metrics.py``): the sum over documents of ``len^2 / 2``.
    Document ids start at 0 in every row."""
    b, s = documents.shape
    rows = torch.arange(b, device=documents.device).unsqueeze(1) * s
    n = torch.bincount((documents + rows).flatten(), minlength=b * s).double()
    return float((n * n / 2).sum())
