"""Normalisation layers; their weights are replicated over tp (grads all-reduced over tp under SP)."""
from __future__ import annotations

from torch import nn

from ..parallel.tensor_parallel import _replicated


def build_norm(kind: str, hidden: int, eps: float, sequence_parallel: bool) -> nn.Module:
    """``RMSNorm`` (Llama) or ``LayerNorm`` (GPT), with init metadata on its parameters."""
    if kind == "RMSNorm":
        norm = nn.RMSNorm(hidden, eps=eps)
    elif kind == "LayerNorm":
        norm = nn.LayerNorm(hidden, eps=eps)
        _replicated(norm.bias, ("zeros",), sequence_parallel)
    else:
        raise ValueError(f"unknown normalization {kind}")
    _replicated(norm.weight, ("ones",), sequence_parallel)
    return norm
