"""Train a tiny model a few steps, save a checkpoint and return its logits on fixed tokens (tp shards gathered
over the vocabulary), for tests/hf/test_export_hf.py."""
from __future__ import annotations

import json

import torch


def train_and_logits(rank, world, overrides, tokens):
    from megatron_lc.parallel.collectives import all_gather
    from megatron_lc.parallel.topology import Axis, Topology
    from megatron_lc.training.loop import Trainer
    from tests.support.parity import small_config

    cfg = small_config(list(overrides))
    topo = Topology.build(tp=cfg.parallel.tensor_model_parallel_size)
    trainer = Trainer(cfg, topo)
    trainer.train()
    b, s = tokens.shape
    with torch.no_grad():
        local = trainer.model(tokens, torch.arange(s).expand(b, s).contiguous())  # [b, s, V/tp]
        return all_gather(local.contiguous(), topo, Axis.TP, dim=2)


def imported_logits(rank, world, import_dir, overrides, tokens):
    """Load an imported checkpoint (``import_dir``: from ``megatron_lc.hf.import_hf``; its model.yaml gives the model
    section) at tp = world unless ``overrides`` say otherwise, train ``train.train_iters`` steps (0: none), return
    (losses, logits on ``tokens``, gathered over the vocabulary)."""
    import os

    import yaml

    from megatron_lc.config import load_config, resolve_layout
    from megatron_lc.parallel.collectives import all_gather
    from megatron_lc.parallel.topology import Axis, Topology
    from megatron_lc.training.loop import Trainer

    with open(os.path.join(import_dir, "model.yaml")) as f:
        model = yaml.safe_load(f)["model"]
    sets = [f"model.{k}={json.dumps(v)}" for k, v in model.items()]  # JSON: YAML that keeps nulls and nesting
    cfg = load_config(None, sets + [f"parallel.tensor_model_parallel_size={world}", "data.mock_data=true",
                                    "data.seq_length=32", "train.device=cpu", "train.micro_batch_size=2",
                                    f"checkpoint.load={import_dir}", "logging.peak_tflops=1"] + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    trainer = Trainer(cfg, topo, layout=layout)
    state = trainer.train()
    b, s = tokens.shape
    if topo.cp > 1:  # logits of the full sequence on every rank: the trained weights in a cp=1 model of this tp
        return state.losses, None
    with torch.no_grad():
        local = trainer.model(tokens, torch.arange(s).expand(b, s).contiguous())  # [b, s, V/tp]
        return state.losses, all_gather(local.contiguous(), topo, Axis.TP, dim=2)
