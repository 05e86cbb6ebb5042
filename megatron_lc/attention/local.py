"""Local (single-rank) causal attention. q/k/v ``[s, b, n, d]`` (k/v may have fewer heads: GQA) ->
``[s, b, nq, d]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LocalCausalAttention(nn.Module):
    """torch SDPA on the whole local sequence (used when cp == 1)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=k_.shape[1] != q_.shape[1])
        return out.permute(2, 0, 1, 3)
