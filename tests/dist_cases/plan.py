"""Rank functions for memory.plan tests under tests.support.dist.run_dist."""
from __future__ import annotations

from megatron_lc.config import load_config
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer

FPDT_SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=256",
              "model.make_vocab_size_divisible_by=64", "data.seq_length=64", "data.mock_data=true",
              "data.prepare_demo_data=false", "train.train_iters=3", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.lr_warmup_iters=1", "checkpoint.save=null",
              "checkpoint.save_interval=null", "logging.metrics_file=/dev/null", "memory.fpdt_chunk_size=16",
              "memory.plan_time_limit=2"]


def fpdt_train(rank, world, overrides):
    """FPDT (configs/tiny_cpu_fpdt.yaml shrunk) for a few steps; returns (losses, arena stats or None, by-tag)."""
    cfg = load_config("configs/tiny_cpu_fpdt.yaml", FPDT_SMALL + list(overrides))
    p = cfg.parallel
    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size,
                          world_size=world)
    trainer = Trainer(cfg, topo)
    losses = trainer.train().losses
    arena = trainer.arena
    return losses, (None if arena is None else arena.stats.summary()), \
        (None if arena is None else arena.layout.size_bytes)
