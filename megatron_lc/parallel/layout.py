"""Sequence layouts: which tokens of the full sequence this cp rank holds.

cp == 1 keeps the whole sequence. Other layouts (zigzag for ring, strided for FPDT) are chosen by
``parallel.cp_comm_type``; tokens, labels, positions and the loss mask move together."""
from __future__ import annotations

import torch

from ..config import Config
from .topology import Topology

SEQ_KEYS = ("tokens", "labels", "position_ids", "loss_mask")


def local_token_index(cfg: Config, topo: Topology, seq_length: int) -> torch.Tensor:
    """Indices into the full sequence of the tokens this rank holds, in local order."""
    if cfg.parallel.cp_comm_type == "fpdt":  # strided chunks (issue 4), also for cp == 1 with SP
        from ..attention.fpdt_layout import check_fpdt_layout, fpdt_token_index, sp_degree

        return fpdt_token_index(seq_length, topo.cp, topo.cp_rank, check_fpdt_layout(cfg), sp_degree(cfg))
    if topo.cp == 1:
        return torch.arange(seq_length)
    raise NotImplementedError(f"sequence layout for cp_comm_type {cfg.parallel.cp_comm_type}")


def shard_batch(batch: dict, cfg: Config, topo: Topology) -> dict:
    """Keep this cp rank's tokens of every per-token tensor of ``batch`` (``[b, s]`` -> ``[b, s_local]``)."""
    if topo.cp == 1 and cfg.parallel.cp_comm_type != "fpdt":
        return batch
    idx = local_token_index(cfg, topo, batch["tokens"].shape[1])
    return {k: (v.index_select(1, idx).contiguous() if k in SEQ_KEYS else v) for k, v in batch.items()}
