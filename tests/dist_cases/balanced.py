"""Rank functions for tests/attention/test_balanced_layout.py: the traffic of the balanced layout's exchange against
its plan, and a rank whose documents are all its own posting nothing."""
from __future__ import annotations

import torch

from megatron_lc.attention.kv_plan import kv_plan
from megatron_lc.config import resolve_layout
from megatron_lc.parallel.token_layout import ring_spans
from tests.dist_cases.documents import DOCS, packed_batch
from tests.support.parity import sharded_loss, small_config


def traffic(rank, world, lengths, seq=32, extra=()):
    """One forward and backward of the small model under ring cp ``world`` with documents of ``lengths`` (and the
    ``extra`` overrides): (the bytes layer 0's attention received in forward and backward, the bytes it sent, what
    the plan says it receives in one forward: rows x 2 (k, v) x rows of the batch x kv heads x head dim x 4 bytes)."""
    cfg = small_config([f"data.seq_length={seq}", f"parallel.context_parallel_size={world}",
                        "parallel.cp_comm_type=p2p"] + DOCS + list(extra))
    layout = resolve_layout(cfg, world)
    batch = packed_batch(seq, lengths)
    _, model, topo = sharded_loss(cfg, layout, batch, float(batch["loss_mask"].sum()))
    spans = ring_spans(True, layout.balance_window, batch["documents"], seq, world)
    rows = kv_plan(batch["documents"], None, spans, seq).received_rows(topo.ring_rank)
    b = batch["tokens"].shape[0]
    planned = rows * 2 * b * layout.kv_heads * cfg.model.kv_channels * torch.float32.itemsize
    got = {op: n for (tag, op), n in topo.comm.received.items() if tag == "layer0.attn"}
    sent = sum(n for (tag, op), n in topo.comm.bytes.items() if tag == "layer0.attn")
    return got, sent, planned
