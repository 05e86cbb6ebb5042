"""Rank functions for the training-loop tests (run under tests.support.dist.run_dist, or directly with world=1)."""
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


def write_format2(path, cfg, full: dict, tp: int) -> None:
    """A checkpoint as format 2 wrote it: ``model_tp{r}.pt`` per tp rank (weights only), meta.json with checksums."""
    import json
    import os

    import torch

    from megatron_lc.parallel.tensor_parallel import cut_shard
    from megatron_lc.training.checkpointing.load import file_digest
    from megatron_lc.training.checkpointing.reshard import partitions

    os.makedirs(path)
    parts = partitions(cfg, tp)
    files = {}
    for r in range(tp):
        name = f"model_tp{r:02d}.pt"
        torch.save({n: cut_shard(t, parts[n], tp, r).contiguous() for n, t in full.items()}, os.path.join(path, name))
        files[name] = file_digest(os.path.join(path, name))
    meta = {"format_version": 2, "iteration": 1, "consumed_samples": 2, "world_size": tp, "tp": tp, "cp": 1, "dp": 1,
            "zero": False, "optimizer": False, "config": cfg.to_dict(), "files": files}
    with open(os.path.join(path, "meta.json"), "w") as f:
        json.dump(meta, f)


def mfu_notices(rank, world, overrides=()):
    """2 steps at dp=world with a peak far too low (MFU above 100%); the warnings this rank logged."""
    import logging

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    keep = Keep()
    logging.getLogger("megatron_lc").addHandler(keep)
    try:
        train(rank, world, ["train.train_iters=2", "train.global_batch_size=4", "train.micro_batch_size=2",
                            "logging.peak_tflops=1e-9", *overrides])
    finally:
        logging.getLogger("megatron_lc").removeHandler(keep)
    return [m for m in keep.messages if "MFU" in m]
