"""Rank functions for the training-loop tests (run under tests.dist.run_dist, or directly with world=1)."""
from __future__ import annotations

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=32", "data.mock_data=true", "train.device=cpu", "train.lr=1e-2", "train.lr_warmup_iters=2",
        "train.min_lr=1e-3", "logging.log_interval=100"]


def train(rank, world, overrides):
    """Train with TINY + overrides on this world; returns (losses, consumed_samples)."""
    cfg = load_config(None, TINY + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    state = Trainer(cfg, topo, layout=layout).train()
    return state.losses, state.consumed_samples
