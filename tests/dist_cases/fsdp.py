"""Rank functions for tests/parallel/test_fsdp.py (run under tests.support.dist.run_dist, or in-process with
world=1)."""
from __future__ import annotations

import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.parallel.expert_parallel import is_expert
from megatron_lc.parallel.fsdp import is_sharded
from megatron_lc.parallel.tensor_parallel import merge_shards
from megatron_lc.parallel.topology import Axis, Topology
from megatron_lc.training.loop import Trainer
from megatron_lc.training.optimizer import clip_grad_norm, sync_gradients

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=2",
        "model.ffn_hidden_size=96", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=64", "data.mock_data=true", "train.device=cpu", "train.lr=1e-3",
        "train.lr_warmup_iters=0", "train.global_batch_size=4", "logging.log_interval=100"]


def full_grad(p, topo: Topology) -> torch.Tensor:
    """The full gradient of parameter ``p``: FSDP shards gathered over dp x cp, an MoE layer's experts over the
    expert group, then tp pieces merged."""
    import torch.distributed as dist

    g = p.grad.full_tensor() if is_sharded(p.grad) else p.grad
    g = g.detach().clone()
    if is_expert(p) and topo.ep > 1:  # an MoE layer's experts: each expert rank's, in expert order
        parts = [torch.empty_like(g) for _ in range(topo.ep)]
        dist.all_gather(parts, g.contiguous(), group=topo.group(Axis.EP))
        g = torch.cat(parts)
    if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
        parts = [torch.empty_like(g) for _ in range(topo.tp)]
        dist.all_gather(parts, g.contiguous(), group=topo.group(Axis.TP))
        g = merge_shards(parts, p.partition)
    return g


def first_step_grads(rank: int, world: int, overrides: list) -> dict:
    """Loss, gradient norm and full gradients of the first step (no update), for TINY + overrides on ``world``."""
    torch.set_num_threads(1)
    cfg = load_config(None, TINY + list(overrides) + ["train.clip_grad=0", "checkpoint.save=null"])
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses) if world > 1 else Topology()
    t = Trainer(cfg, topo, layout=layout)
    t.optimizer.zero_grad(set_to_none=True)
    loss = float(t.forward_backward(t.microbatches(0)))
    sync_gradients(t.model, topo)
    norm = float(clip_grad_norm(t.model, 0.0, topo))
    grads = {n: full_grad(p, topo) for n, p in t.model.named_parameters()}
    sharded = sum(is_sharded(p) for p in t.model.parameters())
    return {"loss": loss, "grad_norm": norm, "grads": grads if rank == 0 else None, "sharded": sharded}


def train(rank: int, world: int, overrides: list) -> list:
    """Losses of TINY + overrides trained on ``world`` ranks."""
    torch.set_num_threads(1)
    cfg = load_config(None, TINY + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses) if world > 1 else Topology()
    return Trainer(cfg, topo, layout=layout).train().losses


def grad_cases(rank: int, world: int, cases: dict) -> dict:
    """``first_step_grads`` of every case ``{name: overrides}`` on this world (one spawn for all of them)."""
    return {name: first_step_grads(rank, world, ov) for name, ov in cases.items()}
