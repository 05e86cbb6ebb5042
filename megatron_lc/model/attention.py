"""Self-attention: QKV projection, RoPE, core attention (chosen by the model spec), output projection."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .rope import apply_rotary


class AttentionProjections(nn.Module):
    """The projections of an attention block: ``linear_qkv`` (column parallel) and ``linear_proj`` (row parallel).

    The fused QKV weight's full layout is grouped by kv head: ``[g0: q_0..q_{r-1}, k, v][g1: ...]`` with
    r = heads / kv heads, so a contiguous tp slice holds whole groups (num_query_groups % tp == 0).
    ``qkv(x, rope)`` -> q, k, v ``[s, b, n, d]`` (local heads; q and k normalised per head with
    ``model.qk_layernorm``, then RoPE applied, then q times ``model.query_scale``).

    The q/k norms (the spec's ``qk_norm``: one weight ``[d]`` each, shared by the heads; None when off)
    act on each head alone, so under tp each rank normalises its own heads and only their weights' gradients are
    summed over tp. ``model.softmax_scale`` reaches every kernel and context-parallel path as q scaled by
    ``softmax_scale * sqrt(d)`` (the kernels scale by ``1/sqrt(d)``): Gemma 3's ``query_pre_attn_scalar``."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__()
        tp = parts.topo.tp
        self.d = cfg.kv_channels
        self.groups_per_rank = cfg.num_query_groups // tp
        self.q_per_group = cfg.num_attention_heads // cfg.num_query_groups
        qkv_out = self.d * (cfg.num_attention_heads + 2 * cfg.num_query_groups)
        self.linear_qkv = parts.column_linear(cfg.hidden_size, qkv_out, bias=cfg.add_bias_linear or cfg.add_qkv_bias,
                                              std=cfg.init_method_std)
        self.linear_proj = parts.row_linear(cfg.num_attention_heads * self.d, cfg.hidden_size,
                                            bias=cfg.add_bias_linear, std=output_std)
        qk_norm = parts.spec.qk_norm
        self.q_layernorm = qk_norm(self.d, cfg.norm_epsilon, tp > 1) if qk_norm is not None else None
        self.k_layernorm = qk_norm(self.d, cfg.norm_epsilon, tp > 1) if qk_norm is not None else None
        self.use_rope = cfg.position_embedding_type == "rope"
        self.query_scale = cfg.query_scale

    def split_qkv(self, mixed: torch.Tensor):
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, self.groups_per_rank, self.q_per_group + 2, self.d)
        q, k, v = torch.split(mixed, [self.q_per_group, 1, 1], dim=3)
        return q.reshape(s, b, -1, self.d), k.squeeze(3), v.squeeze(3)

    def qkv(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.split_qkv(self.linear_qkv(x))
        if self.q_layernorm is not None:
            # on contiguous copies, which the norms save: not views that would keep the whole QKV output alive
            q, k = self.q_layernorm(q.contiguous()), self.k_layernorm(k.contiguous())
        if self.use_rope:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin, self.query_scale), apply_rotary(k, cos, sin)
        elif self.query_scale != 1.0:
            q = q * self.query_scale
        return q, k, v


class SelfAttention(AttentionProjections):
    """``x [s, b, h]`` -> ``qkv`` -> ``core_attention(q, k, v)`` (``attention/core.py``: local, ring, Ulysses or
    hybrid, from the spec) -> ``linear_proj`` -> ``[s, b, h]``. Memory techniques call the three steps apart."""

    def __init__(self, cfg: ModelConfig, parts, layer_number: int, output_std: float):
        super().__init__(cfg, parts, output_std)
        self.core_attention = parts.core_attention(layer_number)

    def forward(self, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        out = self.core_attention(q, k, v, documents)  # documents: config.DocumentRanges, or None
        return self.linear_proj(out.flatten(2))
