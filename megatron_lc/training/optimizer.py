"""AdamW with Megatron's parameter groups, gradient synchronisation, global-norm clipping, LR schedule.

Gradient all-reduce happens over the ranks that replicate a weight: dp x cp for every parameter (the loss is
normalised by the global token count, so a SUM gives the gradient of the global mean), plus tp for replicated
parameters whose gradients are partial under sequence parallelism (norm weights, row biases, learned positions).
An MoE layer's experts under expert parallelism differ between the ranks of an expert group: their gradients are
summed over the expert-data ranks only (``Axis.EDP``, the ranks holding the same experts), and their squares over
the expert group too in the global norm.
``use_distributed_optimizer`` shards AdamW states over dp x cp with torch's ``ZeroRedundancyOptimizer`` (ZeRO-1)."""
from __future__ import annotations

import math

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..config import Config
from ..parallel.collectives import all_reduce
from ..parallel.expert_parallel import is_expert
from ..parallel.fsdp import is_sharded, local
from ..parallel.topology import Axis, Topology

BUCKET_BYTES = 64 * 1024 * 1024


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases and 1-D parameters (norms), as Megatron."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: Config, topo: Topology) -> torch.optim.Optimizer:
    t = cfg.train
    kwargs = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    groups = param_groups(model, t.weight_decay)
    if cfg.parallel.use_distributed_optimizer and topo.size(Axis.DP_CP) > 1:
        # heavy (it imports TorchScript helpers, each one a deprecation warning): only when ZeRO-1 is on
        from torch.distributed.optim import ZeroRedundancyOptimizer

        # ZeroRedundancyOptimizer takes one param list; weight decay per group via add_param_group.
        opt = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=torch.optim.AdamW,
                                      process_group=topo.group(Axis.DP_CP), weight_decay=t.weight_decay, **kwargs)
        if groups[1]["params"]:
            opt.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
        return opt
    return torch.optim.AdamW(groups, **kwargs)


def _bucketed_all_reduce(grads: list[torch.Tensor], topo: Topology, axis: Axis) -> None:
    bucket, size = [], 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= BUCKET_BYTES):
            flat = _flatten_dense_tensors(bucket)
            all_reduce(flat, topo, axis)
            for b, f in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                b.copy_(f)
            bucket, size = [], 0


@torch.no_grad()
def sync_gradients(model: nn.Module, topo: Topology) -> None:
    """Sum the gradients over the ranks that replicate each weight. Under FSDP2 the dp x cp sum was FSDP's
    reduce-scatter in backward: only the tp sum of SP's partial gradients is left (on the shards)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    fsdp = bool(params) and is_sharded(params[0])
    with topo.comm.tag("grad_sync"):
        if topo.tp > 1:
            partial = [local(p.grad) for p in params if getattr(p, "sequence_parallel", False)]
            if partial:
                _bucketed_all_reduce(partial, topo, Axis.TP)
        if topo.size(Axis.DP_CP) > 1 and not fsdp:
            _bucketed_all_reduce([p.grad for p in params if not is_expert(p)], topo, Axis.DP_CP)
            experts = [p.grad for p in params if is_expert(p)]
            if experts and topo.size(Axis.EDP) > 1:  # (EDP is dp x cp's group without expert parallelism)
                _bucketed_all_reduce(experts, topo, Axis.EDP)


@torch.no_grad()
def clip_grad_norm(model: nn.Module, max_norm: float, topo: Topology) -> torch.Tensor:
    """Global L2 norm over the full (unsharded) model; tp-sharded grads are summed over tp, replicated ones counted
    once. Scales grads in place when ``max_norm > 0`` and the norm is finite and above it; returns the norm before
    clipping (a 0-dim fp64 tensor on the grads' device, may be inf/nan). Reads no value: the scale is a tensor
    (1 when no clipping is due; x * 1 is exact)."""
    grads = [p for p in model.parameters() if p.grad is not None]
    device = local(grads[0].grad).device if grads else torch.device("cpu")
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # [tp-sharded, replicated, experts], grads' device
    for p in grads:
        kind = 2 if is_expert(p) else 0 if getattr(p, "tensor_model_parallel", False) else 1
        sums[kind] += local(p.grad).detach().double().pow(2).sum()
    with topo.comm.tag("grad_norm"):
        if grads and is_sharded(grads[0]):  # FSDP2: each rank holds a dp x cp shard of every gradient (the
            all_reduce(sums, topo, Axis.DP_CP)  # experts' an expert-data shard of its expert rank's)
        else:
            all_reduce(sums[2:], topo, Axis.EP)  # each expert rank holds its own experts
        all_reduce(sums[:1], topo, Axis.TP)  # a view: reduced in place
    norm = sums.sum().sqrt()
    if max_norm > 0:
        due = torch.isfinite(norm) & (norm > max_norm)
        scale = torch.where(due, max_norm / (norm + 1e-6), torch.ones_like(norm)).float()
        for p in model.parameters():
            if p.grad is not None:
                local(p.grad).mul_(scale)  # (an FSDP2 gradient: its shard, in place)
    return norm


def lr_at(step: int, cfg: Config) -> float:
    """Linear warmup to ``lr`` over ``lr_warmup_iters``, then cosine/linear/constant decay to ``min_lr``."""
    t = cfg.train
    if t.lr_warmup_iters > 0 and step < t.lr_warmup_iters:
        return t.lr * (step + 1) / t.lr_warmup_iters
    decay_iters = (t.lr_decay_iters or t.train_iters) - t.lr_warmup_iters
    if t.lr_decay_style == "constant" or decay_iters <= 0:
        return t.lr
    frac = min(1.0, max(0.0, (step - t.lr_warmup_iters) / decay_iters))
    if t.lr_decay_style == "linear":
        coeff = 1.0 - frac
    else:
        coeff = 0.5 * (1.0 + math.cos(math.pi * frac))
    return t.min_lr + coeff * (t.lr - t.min_lr)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr
