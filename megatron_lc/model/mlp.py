"""MLP: SwiGLU (Llama) or GeLU (GPT). Token-wise: every output token depends only on its input token."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


class MLP(nn.Module):
    """``fc1`` is column parallel (for SwiGLU its full weight is ``[gate; up]``, ``stride=2`` so each tp rank holds
    its slice of both), ``fc2`` row parallel."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__()
        self.swiglu = cfg.swiglu
        f = cfg.ffn_hidden_size
        self.linear_fc1 = parts.column_linear(cfg.hidden_size, 2 * f if cfg.swiglu else f, bias=cfg.add_bias_linear,
                                              stride=2 if cfg.swiglu else 1, std=cfg.init_method_std)
        self.linear_fc2 = parts.row_linear(f, cfg.hidden_size, bias=cfg.add_bias_linear, std=output_std)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = x.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(x, approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))
