"""Token layouts: which tokens of the full sequence this cp rank holds, in which order.

cp == 1 keeps the whole sequence. Otherwise the layout follows ``parallel.cp_comm_type``; tokens, labels,
positions and the loss mask move together (``shard_batch``), so the model never needs to know the layout (RoPE
reads the positions; the loss is per token).

    p2p      zigzag: 2*cp chunks, cp rank r holds chunks r and 2cp-1-r (causal load balance).
             cp=4, s=16: rank 0 [0 1 | 14 15], rank 1 [2 3 | 12 13], rank 2 [4 5 | 10 11], rank 3 [6 7 | 8 9]
             balanced (``parallel.cp_layout``, the default): the spans ``cp_balance.balanced_spans`` gives each
             micro-batch's documents (the zigzag itself for one causal sequence). cp=2, s=16, documents of 10, 3,
             3 tokens: rank 0 [0 1 2 | 8 9 | 13 14 15], rank 1 [3 4 5 6 7 | 10 11 12]
    a2a      contiguous: rank r holds tokens [r*s/cp, (r+1)*s/cp).
             cp=2, s=8: rank 0 [0 1 2 3], rank 1 [4 5 6 7]
    a2a+p2p  zigzag (or balanced) over the ring (2R chunks; ring rank r's part is [chunk r | chunk 2R-1-r]), then that part cut
             into U contiguous pieces, ulysses rank u holding piece u (so the Ulysses all-to-all gathers exactly
             the ring rank's zigzag part, in order). cp=4 = ring 2 x ulysses 2, s=16, cp rank = ring*U + ulysses:
             cp rank 0 [0 1 2 3], 1 [12 13 14 15]  (ring 0: chunks 0 and 3)
             cp rank 2 [4 5 6 7], 3 [8 9 10 11]    (ring 1: chunks 1 and 2)
    fpdt     strided chunks (``fpdt_token_index`` below): the sequence cut into P*u pieces, rank r holds pieces
             r, r+P, r+2P, ... so that gathered chunk i is global range i. P=2, u=2, s=8: rank 0 [0 1 | 4 5],
             rank 1 [2 3 | 6 7]. Applied even at cp == 1 (sequence parallel splits each chunk over tp).

FPDT's strided layout in detail. The global sequence of ``s`` tokens is cut into ``P*u`` pieces of ``c = s/(P*u)``
tokens (P = cp = Ulysses ranks, u = chunks per rank). cp rank ``r`` holds pieces ``r, r+P, r+2P, ...`` in that
order, so its local chunk ``i`` is piece ``i*P + r``. Example, s = 16, P = 2, u = 2 (pieces of 4 tokens)::

    global tokens:  0-3 | 4-7 | 8-11 | 12-15       pieces 0 1 2 3
    cp rank 0:      0-3, 8-11                       (pieces 0, 2)
    cp rank 1:      4-7, 12-15                      (pieces 1, 3)

The all-to-all of local chunk ``i`` gathers, in rank order, pieces ``iP .. iP+P-1`` = global tokens
``[i*s/u, (i+1)*s/u)``: gathered chunk ``i`` is global range ``i``, so q chunk ``i`` attends fully to kv chunks
``j < i``, causally to ``j == i`` and not at all to ``j > i`` (the FPDT paper's Figure 6).

With Megatron sequence parallelism (tp rank ``t`` holds the contiguous slice ``t`` of the local sequence between
blocks), every piece is further cut into ``tp`` parts and tp rank ``t`` holds part ``t`` of every chunk, so the
column linear's all-gather of one sub-chunk restores that chunk in order. Example, s = 16, P = 1, u = 2, tp = 2
(SP on)::

    local order:    0-3, 8-11 | 4-7, 12-15          tp rank 0 holds 0-3, 8-11; tp rank 1 holds 4-7, 12-15
    chunk 0 = all-gather over tp of (0-3 | 4-7) = tokens 0-7;  chunk 1 = (8-11 | 12-15) = tokens 8-15
"""
from __future__ import annotations

from typing import Optional

import torch

from ..config import ConfigError, Layout
from ..config.documents import DocumentRanges
from .cp_balance import balanced_spans, zigzag_spans
from .topology import Topology

SEQ_KEYS = ("tokens", "labels", "position_ids", "loss_mask")


def contiguous_index(seq_length: int, n: int, rank: int) -> torch.Tensor:
    """Tokens ``[rank*s/n, (rank+1)*s/n)``."""
    if seq_length % n != 0:
        raise ConfigError(f"sequence length ({seq_length}) must be divisible by the Ulysses size ({n})")
    c = seq_length // n
    return torch.arange(rank * c, (rank + 1) * c)


def fpdt_token_index(seq_length: int, cp: int, cp_rank: int, num_chunks: int, sp_tp: int = 1) -> torch.Tensor:
    """Indices into the full sequence of the tokens cp rank ``cp_rank`` holds under FPDT, in local order.

    Local position ``t*(s_local/sp_tp) + i*(c/sp_tp) + j`` holds global token ``(i*cp + cp_rank)*c + t*(c/sp_tp) + j``
    with ``c = s/(cp*u)`` (piece size), ``t < sp_tp``, ``i < u``, ``j < c/sp_tp``."""
    if seq_length % (cp * num_chunks) != 0 or (seq_length // (cp * num_chunks)) % sp_tp != 0:
        raise ConfigError(f"FPDT layout: seq_length ({seq_length}) must be divisible by cp ({cp}) x chunks "
                          f"({num_chunks}) x sp tp ({sp_tp})")
    c = seq_length // (cp * num_chunks)
    part = c // sp_tp
    t = torch.arange(sp_tp).view(sp_tp, 1, 1)
    i = torch.arange(num_chunks).view(1, num_chunks, 1)
    j = torch.arange(part).view(1, 1, part)
    return ((i * cp + cp_rank) * c + t * part + j).reshape(-1)


def chunk_rows(s_local: int, num_chunks: int, sp_tp: int = 1) -> list[torch.Tensor]:
    """For each FPDT chunk ``i``, the local positions of its tokens in gathered (tp all-gather) order.

    Without SP this is the contiguous range ``[i*s_local/u, (i+1)*s_local/u)``; with SP (``sp_tp`` > 1) it is
    ``t*(s_local/sp_tp) + i*(c/sp_tp) + j`` for t, j in order (c = s_local/u)."""
    c = s_local // num_chunks
    part = c // sp_tp
    t = torch.arange(sp_tp).view(sp_tp, 1)
    j = torch.arange(part).view(1, part)
    return [(t * (s_local // sp_tp) + i * part + j).reshape(-1) for i in range(num_chunks)]


def ring_spans(balanced: bool, balance_window: Optional[int], documents: Optional[DocumentRanges], seq_length: int,
               R: int) -> tuple:
    """Each ring rank's global ``(start, end)`` spans in local order: the balanced layout of the micro-batch's
    documents and ``balance_window`` (``Layout.balance_window``) when ``balanced``, else the zigzag."""
    return balanced_spans(documents, seq_length, R, balance_window) if balanced else zigzag_spans(seq_length, R)


def spans_index(spans) -> torch.Tensor:
    """``((g0, g1), ...)`` -> the positions, in that order."""
    return torch.cat([torch.arange(a, b) for a, b in spans])


def local_token_index(layout: Layout, topo: Topology, seq_length: int,
                      documents: Optional[DocumentRanges] = None) -> torch.Tensor:
    """Indices into the full sequence of the tokens this rank holds, in local order (``seq_length`` is the
    batch's: a batch of another length than the config's is refused with the layout's rule; ``documents``: the
    micro-batch's, which the balanced layout follows)."""
    if layout.cp_comm_type == "fpdt":  # strided chunks, also for cp == 1 (SP splits each chunk over tp)
        return fpdt_token_index(seq_length, topo.cp, topo.cp_rank, layout.fpdt_chunks, layout.sp_degree)
    if topo.cp == 1:
        return torch.arange(seq_length)
    kind = layout.cp_comm_type
    if seq_length % layout.seq_multiple != 0:
        raise ConfigError(f"sequence length ({seq_length}) must be divisible by {layout.seq_multiple} for cp "
                          f"({topo.cp}, {kind}); pad the data or change data.seq_length")
    # p2p: ulysses = 1 (the ring rank's spans); a2a: ring = 1 (the whole sequence, then contiguous pieces).
    part = torch.arange(seq_length)
    if topo.ring > 1:
        spans = ring_spans(layout.cp_layout == "balanced", layout.balance_window, documents, seq_length, topo.ring)
        part = spans_index(spans[topo.ring_rank])
    return part[contiguous_index(part.numel(), topo.ulysses, topo.ulysses_rank)]


def shard_batch(batch: dict, layout: Layout, topo: Topology) -> dict:
    """Keep this cp rank's tokens of every per-token tensor of ``batch`` (``[b, s]`` -> ``[b, s_local]``)."""
    if topo.cp == 1 and layout.cp_comm_type != "fpdt":
        return batch
    idx = local_token_index(layout, topo, batch["tokens"].shape[1], batch.get("documents"))
    return {k: (v.index_select(1, idx).contiguous() if k in SEQ_KEYS else v) for k, v in batch.items()}
