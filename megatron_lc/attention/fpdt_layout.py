"""FPDT's strided chunk layout: which tokens a cp rank holds, and the chunk rules of the config.

The global sequence of ``s`` tokens is cut into ``P*u`` pieces of ``c = s/(P*u)`` tokens (P = cp = Ulysses ranks,
u = chunks per rank, ``u = s / memory.fpdt_chunk_size``). cp rank ``r`` holds pieces ``r, r+P, r+2P, ...`` in that
order, so its local chunk ``i`` is piece ``i*P + r``. Example, s = 16, P = 2, u = 2 (pieces of 4 tokens)::

    global tokens:  0-3 | 4-7 | 8-11 | 12-15       pieces 0 1 2 3
    cp rank 0:      0-3, 8-11                       (pieces 0, 2)
    cp rank 1:      4-7, 12-15                      (pieces 1, 3)

The all-to-all of local chunk ``i`` gathers, in rank order, pieces ``iP .. iP+P-1`` = global tokens
``[i*s/u, (i+1)*s/u)``: gathered chunk ``i`` is global range ``i``, so q chunk ``i`` attends fully to kv chunks
``j < i``, causally to ``j == i`` and not at all to ``j > i`` (the paper's Figure 6).

With Megatron sequence parallelism (tp rank ``t`` holds the contiguous slice ``t`` of the local sequence between
blocks), every piece is further cut into ``tp`` parts and tp rank ``t`` holds part ``t`` of every chunk, so the
column linear's all-gather of one sub-chunk restores that chunk in order. Example, s = 16, P = 1, u = 2, tp = 2
(SP on)::

    local order:    0-3, 8-11 | 4-7, 12-15          tp rank 0 holds 0-3, 8-11; tp rank 1 holds 4-7, 12-15
    chunk 0 = all-gather over tp of (0-3 | 4-7) = tokens 0-7;  chunk 1 = (8-11 | 12-15) = tokens 8-15

Tokens, labels, positions and the loss mask are permuted together by ``parallel/layout.py`` (no cost in the model).
"""
from __future__ import annotations

import torch

from ..config import Config, ConfigError


def fpdt_chunk_tokens(cfg: Config) -> int:
    """Tokens of one gathered chunk (``memory.fpdt_chunk_size``; default: the whole sequence, u = 1)."""
    return cfg.memory.fpdt_chunk_size or cfg.data.seq_length


def sp_degree(cfg: Config) -> int:
    """tp when Megatron sequence parallelism splits the local sequence over tp ranks, else 1."""
    p = cfg.parallel
    return p.tensor_model_parallel_size if (p.sequence_parallel and p.tensor_model_parallel_size > 1) else 1


def check_fpdt_layout(cfg: Config) -> int:
    """Validate the FPDT chunk rules; return u (chunks per rank). One-line ConfigError naming the numbers."""
    s, chunk = cfg.data.seq_length, fpdt_chunk_tokens(cfg)
    cp, spt = cfg.parallel.context_parallel_size, sp_degree(cfg)
    if chunk > s or s % chunk != 0:
        raise ConfigError(f"memory.fpdt_chunk_size ({chunk}) must divide data.seq_length ({s}) "
                          f"(FPDT cuts the sequence into equal chunks; no padding)")
    if chunk % (cp * spt) != 0:
        raise ConfigError(f"memory.fpdt_chunk_size ({chunk}) must be divisible by cp ({cp})"
                          + (f" x tp ({spt}) with sequence_parallel" if spt > 1 else "")
                          + f" = {cp * spt}: each rank contributes chunk/{cp * spt} tokens to every chunk")
    return s // chunk


def fpdt_token_index(seq_length: int, cp: int, cp_rank: int, num_chunks: int, sp_tp: int = 1) -> torch.Tensor:
    """Indices into the full sequence of the tokens cp rank ``cp_rank`` holds, in local order (see module doc).

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
    """For each chunk ``i``, the local positions of its tokens in gathered (tp all-gather) order.

    Without SP this is the contiguous range ``[i*s_local/u, (i+1)*s_local/u)``; with SP (``sp_tp`` > 1) it is
    ``t*(s_local/sp_tp) + i*(c/sp_tp) + j`` for t, j in order (c = s_local/u)."""
    c = s_local // num_chunks
    part = c // sp_tp
    t = torch.arange(sp_tp).view(sp_tp, 1)
    j = torch.arange(part).view(1, part)
    return [(t * (s_local // sp_tp) + i * part + j).reshape(-1) for i in range(num_chunks)]
