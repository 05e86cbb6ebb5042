"""Rotary position embedding (non-interleaved halves, as Llama / Hugging Face / Megatron's default)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """``cos, sin = rope(position_ids)`` for per-token positions ``[s, b]`` -> ``[s, b, 1, d]`` each (fp32).

    Positions come from the data path, so any sequence layout (zigzag, strided) gets the right angles."""

    def __init__(self, dim: int, base: float):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float(),
                             persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[s, b, n, d]``; cos/sin: ``[s, b, 1, d]``."""
    return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)
