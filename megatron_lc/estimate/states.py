"""Bytes of the model states per rank: parameters, gradients, master weights, optimizer states.

``framework`` is what this project's trainer holds (``training/optimizer.py``): fp32 parameters (the master
weights; ``train.bf16`` autocasts on GPU and caches bf16 copies of the matrices for the step), fp32 gradients,
AdamW's two fp32 states, sharded over dp x cp by ZeRO-1 (torch's ``ZeroRedundancyOptimizer``: whole parameters
per rank, the partition of ``inventory.zero1_partition``) with ``parallel.use_distributed_optimizer``; with
``parallel.use_torch_fsdp2`` all three sharded over dp x cp (``fsdp_state_bytes``).

The other presets are *what-ifs* for comparing with the papers' systems; the framework does not implement them:

* ``megatron``: Megatron-LM mixed precision (Memo's base): bf16 parameters, fp32 main gradients, fp32 master
  weights and AdamW states sharded by its distributed optimizer over dp x cp; bf16 residual stream.
* ``zero3``: DeepSpeed ZeRO-3 (FPDT's setup): bf16 parameters and gradients, fp32 master and AdamW states, all
  sharded over every rank; plus the gathered bf16 parameters of two layers (the one computing, the prefetched one).
* ``bf16_optim_in_backward``: pure bf16 with the optimizer step fused into the backward (MsT's single-GPU setup,
  its Appendix D): bf16 parameters and AdamW states, no gradient buffer.
"""
from __future__ import annotations

import dataclasses

from ..config import Config, ConfigError
from . import moe
from .dims import Dims
from .inventory import param_shards, zero1_partition

PRESETS = ("framework", "megatron", "zero3", "bf16_optim_in_backward")


def dims_for(dims: Dims, preset: str) -> Dims:
    """The dtypes of activations under ``preset``: what-if presets run bf16 end to end (residual stream too)."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown model-state preset '{preset}'; valid: {', '.join(PRESETS)}")
    return dims if preset == "framework" else dataclasses.replace(dims, compute_bytes=2, residual_bytes=2)


def model_state_bytes(cfg: Config, dims: Dims, preset: str = "framework") -> dict:
    """``params``/``grads``/``optimizer`` (master + states)/``autocast_copies`` bytes of the largest rank, and what
    the transient formulas need (``numels``, ``state_numel``, the head's and one layer's gradient bytes)."""
    shards = param_shards(dims)
    numels = [n for _, n, _ in shards]
    total = sum(numels)
    layer = sum(n for name, n, _ in shards if name.startswith("layers.0."))
    head = (dims.vocab_local * dims.hidden if dims.untied_head else 0) + dims.hidden
    zero_ranks = dims.dp * dims.cp
    if preset == "framework" and cfg.parallel.use_torch_fsdp2:  # (an expert rank's experts over the ep-times
        # fewer expert-data ranks: its shard is as large as if all experts were cut over dp x cp)
        full = [n * (dims.ep if moe.is_expert_param(name) else 1) for name, n, _ in shards]
        return fsdp_state_bytes(cfg, dims, full, layer, head)
    if preset == "framework":
        if cfg.parallel.use_distributed_optimizer and zero_ranks > 1:
            state_numel = max(zero1_partition(shards, zero_ranks))
        else:
            state_numel = total
        matrices = sum(n for name, n, decay in shards if decay and not name.startswith(("embedding", "position")))
        return {"params": 4.0 * total, "grads": 4.0 * total, "optimizer": 8.0 * state_numel,
                "autocast_copies": 2.0 * matrices if dims.compute_bytes == 2 else 0.0, "numels": numels,
                "state_numel": state_numel, "head_grad": 4.0 * head, "layer_grad": 4.0 * layer,
                "persistent_grads": False}
    if preset == "megatron":
        shard = zero_ranks if cfg.parallel.use_distributed_optimizer else 1
        return {"params": 2.0 * total, "grads": 4.0 * total, "optimizer": 12.0 * total / shard,
                "autocast_copies": 0.0, "numels": numels, "state_numel": total / shard, "head_grad": 4.0 * head,
                "layer_grad": 4.0 * layer, "persistent_grads": True}  # Megatron's main-grad buffer lives on
    if preset == "zero3":
        n = dims.world  # every rank (dp x sequence-parallel; tp = 1 in DeepSpeed Ulysses setups)
        return {"params": 2.0 * total / n + 2 * 2.0 * layer, "grads": 2.0 * total / n, "optimizer": 12.0 * total / n,
                "autocast_copies": 0.0, "numels": [m / n for m in numels], "state_numel": total / n,
                "head_grad": 2.0 * head / n, "layer_grad": 2.0 * layer, "persistent_grads": True}
    # bf16_optim_in_backward
    return {"params": 2.0 * total, "grads": 0.0, "optimizer": 4.0 * total, "autocast_copies": 0.0,
            "numels": numels, "state_numel": total, "head_grad": 2.0 * head, "layer_grad": 2.0 * layer,
            "persistent_grads": False}


def fsdp_state_bytes(cfg: Config, dims: Dims, numels: list, layer: float, head: float) -> dict:
    """FSDP2 (``parallel/fsdp.py``): fp32 shards of the parameters, their gradients and AdamW states, 1/(dp x cp)
    each; on the device also the gathered weights in the compute dtype of two layers (the one computing and the one
    prefetched), of the embedding / head unit at the head's moments (``head_gathered``), and one layer's unsharded
    gradients (compute dtype + the fp32 copy reduce-scattered). A unit's fp32 reduce-scatter input stays alive until
    the next unit's reduce-scatter is issued, so the last layer's backward holds the head's (fp32) beside its own
    gradients in the compute dtype (``last_layer_grads``). ``fsdp_cpu_offload``: the shards, gradients and AdamW
    states are host memory (``host``), AdamW runs on the host."""
    n = dims.dp * dims.cp
    total = sum(numels)
    shard = total / n
    # on a CPU run the host is the device: the offload moves nothing (the GPU split is not measured here)
    dev = 0.0 if cfg.parallel.fsdp_cpu_offload and dims.device != "cpu" else 1.0
    return {"params": 4.0 * shard * dev + dims.compute_bytes * 2 * layer,  # + two gathered layers, in the compute dtype
            # the embedding / head unit, at the head's moments
            "head_gathered": dims.compute_bytes * max(dims.vocab_local * dims.hidden, head),
            "grads": 4.0 * shard * dev, "optimizer": 8.0 * shard * dev,
            "autocast_copies": 0.0, "numels": [m / n * dev for m in numels], "state_numel": shard * dev,
            "head_grad": (dims.compute_bytes + 4.0) * head, "layer_grad": (dims.compute_bytes + 4.0) * layer,
            "last_layer_grads": 4.0 * head + dims.compute_bytes * layer,
            "persistent_grads": False,  # zero_grad(set_to_none) frees the sharded gradients after each step
            "host": 16.0 * shard * (1.0 - dev)}
