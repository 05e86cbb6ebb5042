"""The model states' communication of a step, overlapped the way the system issues it.

Three ways, by who holds the states (``states.py``'s presets; ``framework`` reads the config):

* ``after_backward`` -- this framework without FSDP2 (``training/optimizer.sync_gradients``): the fp32 gradients are
  all-reduced over dp x cp in buckets once the last micro-batch's backward is over, and ZeRO-1's owners broadcast
  the updated fp32 parameters after the step; nothing overlaps them.
* ``per_layer`` -- this framework's FSDP2 (``parallel/fsdp.py``) and DeepSpeed's ZeRO-3 (the ``zero3`` what-if):
  each layer's weights are all-gathered in the compute dtype one layer ahead in forward and in backward, and its
  fp32 gradients reduce-scattered as its backward ends. A layer's gather hides under the previous layer's forward,
  its gather and the next layer's reduce-scatter under its backward (and re-run); only the excess is exposed, per
  layer, plus the first gather of each pass. With ``fsdp_cpu_offload`` the shards also cross PCIe.
* ``overlapped`` -- Megatron-LM's distributed optimizer (the ``megatron`` what-if, Memo's base) with its bucketed
  ``--overlap-grad-reduce`` / ``--overlap-param-gather``: the fp32 reduce-scatter runs under the last micro-batch's
  backward, the bf16 all-gather under the next forward; only what exceeds them is exposed. Memo does not say which
  flags it ran.

Example, 13B GPT at 64K on 16 A800 (tp 2, cp 2, dp 4: gradient sync over 8 ranks two apart, spanning both nodes;
4 ranks a node pool their NICs, 80 GB/s): ``after_backward`` all-reduces 2 x 7/8 x 4 x 6.5e9 bytes (0.57 s) and
broadcasts half that (0.28 s) after a 15.7 s step; ``overlapped`` hides both under the backward.
"""
from __future__ import annotations

from ..config import Config
from . import moe
from .dims import Dims
from .hardware import HardwareProfile
from .inventory import param_shards


def sync_style(cfg: Config, states: str) -> str:
    """How the states' communication is issued (module doc)."""
    if states == "megatron":
        return "overlapped"
    if states == "zero3" or (states == "framework" and cfg.parallel.use_torch_fsdp2):
        return "per_layer"
    return "after_backward"


def layer_numels(dims: Dims) -> tuple[float, float]:
    """(one layer's local parameters, all local parameters) of a tp rank."""
    shards = param_shards(dims)
    return float(sum(n for name, n, _ in shards if name.startswith("layers.0."))), float(sum(n for _, n, _ in shards))


def per_layer_exposed(cfg: Config, dims: Dims, hw: HardwareProfile, ranks: int, fwd: float, bwd: float,
                      states: str) -> float:
    """Seconds per micro-batch that ``per_layer`` sharding leaves exposed: per layer ``max(0, gather - fwd)`` in
    forward and ``max(0, gather + reduce-scatter - bwd)`` in backward (``fwd`` / ``bwd``: one layer's seconds, the
    re-run in ``bwd``), the first gather of each pass, and the embedding / head units' traffic whole. ``ranks``: the
    sharding group (dp x cp for FSDP2, every rank for ZeRO-3).

    Example: Llama3-8B at 1M tokens on 8 H100 (FSDP2 over 8, bf16): a layer's 218M parameters gather 7/8 x 0.44
    GB in 1.1 ms and reduce-scatter 7/8 x 0.87 GB in 2.1 ms at 360 GB/s; a layer's forward takes 3.4 s: nothing
    exposed but the first gathers and the embedding / head units (23 ms a step)."""
    if ranks <= 1 and not cfg.parallel.fsdp_cpu_offload:
        return 0.0
    layer, total = layer_numels(dims)
    other = total - dims.num_layers * layer
    grad_bytes = 4.0 if states == "framework" else dims.compute_bytes  # FSDP2 reduces fp32, ZeRO-3 bf16
    bw = hw.collective_bytes_per_s(ranks, dims.tp)
    host = hw.host_copy_bytes_per_s(min(dims.world, hw.gpus_per_node))
    share = (ranks - 1) / ranks if ranks > 1 else 0.0

    def gather(n: float) -> float:
        secs = share * n * dims.compute_bytes / bw if ranks > 1 else 0.0
        return secs + (4.0 * n / ranks / host if cfg.parallel.fsdp_cpu_offload else 0.0)

    def scatter(n: float) -> float:
        secs = share * n * grad_bytes / bw if ranks > 1 else 0.0
        return secs + (4.0 * n / ranks / host if cfg.parallel.fsdp_cpu_offload else 0.0)

    g, rs = gather(layer), scatter(layer)
    per_layer = max(0.0, g - fwd) + max(0.0, g + rs - bwd)
    return dims.num_layers * per_layer + 2 * g + 2 * gather(other) + scatter(other)


def sync_seconds(cfg: Config, dims: Dims, hw: HardwareProfile, states: str, fwd: float, bwd: float,
                 micro_fwd: float, micro_bwd: float) -> float:
    """Exposed seconds of the model states' communication in one step (module doc). ``fwd`` / ``bwd``: one layer's
    forward and backward (+ re-run) seconds per micro-batch; ``micro_fwd`` / ``micro_bwd``: a micro-batch's."""
    style = sync_style(cfg, states)
    n = dims.dp * dims.cp
    if style == "per_layer":
        ranks = dims.world if states == "zero3" else n
        return dims.micro_batches * per_layer_exposed(cfg, dims, hw, ranks, fwd, bwd, states)
    total = 0.0
    for numel, ranks, stride in reduce_groups(dims):
        if ranks <= 1:
            continue
        bw = hw.collective_bytes_per_s(ranks, stride)
        share = (ranks - 1) / ranks
        if style == "overlapped":  # fp32 reduce-scatter under the backward, bf16 all-gather under the next forward
            total += max(0.0, share * 4 * numel / bw - micro_bwd) + max(0.0, share * 2 * numel / bw - micro_fwd)
            continue
        total += 2 * share * 4 * numel / bw  # fp32 all-reduce after the backward
        if cfg.parallel.use_distributed_optimizer:
            total += share * 4 * numel / bw  # ZeRO-1's owners broadcast the updated fp32 parameters
    return total


def reduce_groups(dims: Dims) -> list[tuple[float, int, int]]:
    """(a tp rank's local parameters, the ranks their gradients are summed over, those ranks' stride): everything
    over dp x cp (tp apart); under expert parallelism the experts apart, over their dp x cp / ep expert-data ranks
    (tp x ep apart). Example, 8 ranks, tp 1, dp 8, ep 4: the dense weights over 8, the experts over 2 ranks 4 apart."""
    n = dims.dp * dims.cp
    shards = param_shards(dims)
    experts = sum(k for name, k, _ in shards if moe.is_expert_param(name)) if dims.ep > 1 else 0.0
    dense = float(sum(k for _, k, _ in shards)) - experts
    groups = [(dense, n, dims.tp)]
    if experts:
        groups.append((float(experts), n // dims.ep, dims.tp * dims.ep))
    return groups
