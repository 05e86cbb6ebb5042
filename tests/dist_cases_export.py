"""Train a tiny model a few steps, save a checkpoint and return its logits on fixed tokens (tp shards gathered
over the vocabulary), for tests/test_export_hf.py."""
from __future__ import annotations

import torch


def train_and_logits(rank, world, overrides, tokens):
    from megatron_lc.parallel.collectives import all_gather
    from megatron_lc.parallel.topology import Axis, Topology
    from megatron_lc.training.loop import Trainer
    from tests.parity import small_config

    cfg = small_config(list(overrides))
    topo = Topology.build(tp=cfg.parallel.tensor_model_parallel_size)
    trainer = Trainer(cfg, topo)
    trainer.train()
    b, s = tokens.shape
    with torch.no_grad():
        local = trainer.model(tokens, torch.arange(s).expand(b, s).contiguous())  # [b, s, V/tp]
        return all_gather(local.contiguous(), topo, Axis.TP, dim=2)
