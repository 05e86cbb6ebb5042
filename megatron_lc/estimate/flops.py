"""FLOPs of one rank's share of a micro-batch, split the way the time model needs them.

Model FLOPs per sample (Memo §5.1, FlashAttention with the causal mask): ``6·s·P + 6·n·h·s²``. Its parts:
``2·s·P`` forward for the linears (and 4·s·P backward), and for attention ``2·n·h·s²`` forward — QKᵀ and PV are
``2·s²·d`` each per head, halved by the causal mask — and twice that backward. With document masks one ``s`` of
``s²`` becomes the length-weighted mean document length (``Dims.attended``; the training metrics count each step's
own documents instead). The time model spreads that work evenly over the cp ranks; how uneven the zigzag layout
leaves it on a corpus is what ``bench/document_balance.py`` prints. Hardware FLOPs add what the
memory techniques recompute, and FlashAttention's backward recomputes QKᵀ (2.5x the forward instead of 2x).
"""
from __future__ import annotations

from dataclasses import dataclass

from . import moe
from .dims import Dims
from .inventory import param_shards


@dataclass(frozen=True)
class LayerFlops:
    """Per rank, per micro-batch, one transformer layer."""

    linear_fwd: float  # the token-wise part: QKV, out-proj, MLP
    attn_fwd: float  # core attention (causal)

    @property
    def model_fwd_bwd(self) -> float:
        return 3 * self.linear_fwd + 3 * self.attn_fwd


def layer_flops(dims: Dims) -> LayerFlops:
    """``dims.tokens`` tokens of this rank through a layer whose weights are 1/tp of the full layer. Attention: this
    rank's tokens attend to ``s`` keys on average ``s/2`` (causal), over its ``nq/tp`` heads — the same for ring
    (load-balanced zigzag), Ulysses (whole sequence, nq/tp/u heads) and FPDT."""
    h, d = dims.hidden, dims.head_dim
    heads, kv_heads = dims.heads_local, dims.kv_heads_local
    mlp = h * dims.ffn_local * (3 if dims.swiglu else 2)
    linear_fwd = 2.0 * dims.tokens * (h * (heads + 2 * kv_heads) * d + heads * d * h + mlp)
    if dims.moe:  # the MoE layers' MLP: the router, k experts a token, the shared expert (the mean over the layers)
        linear_fwd += sum(dims.moe_layers) / dims.num_layers * (moe.flops_fwd(dims) - 2.0 * dims.tokens * mlp)
    attn_fwd = 2.0 * dims.tokens * dims.attended * dims.heads_local * d  # 4·t·s·d per head, halved by the mask
    return LayerFlops(linear_fwd, attn_fwd)


def head_flops_fwd(dims: Dims) -> float:
    return 2.0 * dims.tokens * dims.hidden * dims.vocab_local


def model_flops_per_sample(dims: Dims) -> float:
    """Memo §5.1: 6·s·P + 6·n·h·s² (P the full parameter count, embeddings included; h = nq·d; of an MoE layer the
    active parameters: its router and k of its experts, as ``ModelConfig.num_active_parameters`` counts them)."""
    full = Dims(**{**dims.__dict__, "tp": 1, "cp": 1, "dp": 1, "sequence_parallel": False, "ep": 1})
    active = dims.topk / dims.experts if dims.experts else 1.0
    P = sum(n * (active if moe.is_expert_param(name) else 1.0) for name, n, _ in param_shards(full))
    s = dims.seq_length
    return 6.0 * s * P + 6.0 * dims.num_layers * dims.heads * dims.head_dim * s * dims.attended
