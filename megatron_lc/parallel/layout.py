"""Sequence layouts: which tokens of the full sequence this cp rank holds.

cp == 1 keeps the whole sequence. Otherwise the layout follows ``parallel.cp_comm_type``; tokens, labels,
positions and the loss mask move together (``shard_batch``), so the model never needs to know the layout (RoPE
reads the positions; the loss is per token).

    p2p      zigzag: 2*cp chunks, cp rank r holds chunks r and 2cp-1-r (causal load balance).
             cp=4, s=16: rank 0 [0 1 | 14 15], rank 1 [2 3 | 12 13], rank 2 [4 5 | 10 11], rank 3 [6 7 | 8 9]
    a2a      contiguous: rank r holds tokens [r*s/cp, (r+1)*s/cp).
             cp=2, s=8: rank 0 [0 1 2 3], rank 1 [4 5 6 7]
    a2a+p2p  zigzag over the ring (2R chunks; ring rank r's part is [chunk r | chunk 2R-1-r]), then that part cut
             into U contiguous pieces, ulysses rank u holding piece u (so the Ulysses all-to-all gathers exactly
             the ring rank's zigzag part, in order). cp=4 = ring 2 x ulysses 2, s=16, cp rank = ring*U + ulysses:
             cp rank 0 [0 1 2 3], 1 [12 13 14 15]  (ring 0: chunks 0 and 3)
             cp rank 2 [4 5 6 7], 3 [8 9 10 11]    (ring 1: chunks 1 and 2)
    fpdt     strided chunks (attention/fpdt_layout.py): the sequence cut into P*u pieces, rank r holds pieces
             r, r+P, r+2P, ... so that gathered chunk i is global range i. P=2, u=2, s=8: rank 0 [0 1 | 4 5],
             rank 1 [2 3 | 6 7]. Applied even at cp == 1 (sequence parallel splits each chunk over tp).
"""
from __future__ import annotations

import torch

from ..config import Config, ConfigError
from .topology import Topology

SEQ_KEYS = ("tokens", "labels", "position_ids", "loss_mask")


def zigzag_index(seq_length: int, ring: int, ring_rank: int) -> torch.Tensor:
    """Tokens of chunks ``ring_rank`` and ``2*ring-1-ring_rank`` of ``2*ring`` equal chunks, in that order."""
    if seq_length % (2 * ring) != 0:
        raise ConfigError(f"sequence length ({seq_length}) must be divisible by 2 x ring size ({2 * ring}) for the "
                          f"zigzag layout")
    c = seq_length // (2 * ring)
    front = torch.arange(ring_rank * c, (ring_rank + 1) * c)
    back = torch.arange((2 * ring - 1 - ring_rank) * c, (2 * ring - ring_rank) * c)
    return torch.cat([front, back])


def contiguous_index(seq_length: int, n: int, rank: int) -> torch.Tensor:
    """Tokens ``[rank*s/n, (rank+1)*s/n)``."""
    if seq_length % n != 0:
        raise ConfigError(f"sequence length ({seq_length}) must be divisible by the Ulysses size ({n})")
    c = seq_length // n
    return torch.arange(rank * c, (rank + 1) * c)


def local_token_index(cfg: Config, topo: Topology, seq_length: int) -> torch.Tensor:
    """Indices into the full sequence of the tokens this rank holds, in local order."""
    if cfg.parallel.cp_comm_type == "fpdt":  # strided chunks (issue 4), also for cp == 1 with SP
        from ..attention.fpdt_layout import check_fpdt_layout, fpdt_token_index, sp_degree

        return fpdt_token_index(seq_length, topo.cp, topo.cp_rank, check_fpdt_layout(cfg), sp_degree(cfg))
    if topo.cp == 1:
        return torch.arange(seq_length)
    kind = cfg.parallel.cp_comm_type
    if seq_length % cfg.seq_multiple() != 0:
        raise ConfigError(f"sequence length ({seq_length}) must be divisible by {cfg.seq_multiple()} for cp "
                          f"({topo.cp}, {kind}); pad the data or change data.seq_length")
    if kind in ("p2p", "a2a", "a2a+p2p"):
        # p2p: ulysses = 1 (pure zigzag); a2a: ring = 1 (zigzag of 2 chunks = whole sequence, then contiguous).
        part = zigzag_index(seq_length, topo.ring, topo.ring_rank) if topo.ring > 1 else torch.arange(seq_length)
        return part[contiguous_index(part.numel(), topo.ulysses, topo.ulysses_rank)]
    raise ConfigError(f"sequence layout for cp_comm_type {kind} is not implemented yet")


def shard_batch(batch: dict, cfg: Config, topo: Topology) -> dict:
    """Keep this cp rank's tokens of every per-token tensor of ``batch`` (``[b, s]`` -> ``[b, s_local]``)."""
    if topo.cp == 1 and cfg.parallel.cp_comm_type != "fpdt":
        return batch
    idx = local_token_index(cfg, topo, batch["tokens"].shape[1])
    return {k: (v.index_select(1, idx).contiguous() if k in SEQ_KEYS else v) for k, v in batch.items()}
