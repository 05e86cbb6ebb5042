"""Normalisation layers; their weights are replicated over tp (grads all-reduced over tp under SP).

``RMSNorm`` saves what a fused kernel saves -- the input and one ``rstd`` per token -- on every device. On CUDA it
calls ``F.rms_norm`` (torch's fused kernel, which saves input + rstd; never executed here). On CPU ``F.rms_norm`` is a
composite of pow/mean/rsqrt/mul whose autograd also keeps the normalised ``x * rstd`` (one more hidden-sized tensor
per norm, 1 KiB a token for h = 256 in fp32), so the CPU twin is a small autograd function with the fused kernel's
saved set and the composite's arithmetic (upcast, normalise, cast back, then scale by the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import _replicated


class _RMSNormFunction(torch.autograd.Function):
    """y = (x·rstd).to(x.dtype) · w, rstd = 1/sqrt(mean(x², -1) + eps) in fp32 (or x's dtype if wider). Saves x and
    rstd; backward recomputes x·rstd (one temporary)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_opmath(x.dtype))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
        y = (xf * rstd).to(x.dtype).mul_(weight)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, g):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(rstd.dtype) * rstd  # normalised x, fp32
        dweight = None
        if ctx.needs_input_grad[1]:
            dweight = (g * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            gn = (g * weight).to(rstd.dtype)
            dot = (gn * n).mean(-1, keepdim=True)
            dx = gn.sub_(n.mul_(dot)).mul_(rstd).to(x.dtype)
        return dx, dweight, None


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    """Drop-in for ``nn.RMSNorm(hidden, eps)`` (same parameter name ``weight``, same values), saving only input + rstd
    for backward on every device."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.normalized_shape = (hidden,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # torch's fused kernel (GPU only, never executed here)
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        if torch.is_autocast_enabled(x.device.type):  # autocast runs norms in the input's dtype, as F.rms_norm does
            with torch.autocast(x.device.type, enabled=False):
                return _RMSNormFunction.apply(x, self.weight.to(x.dtype), self.eps)
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


def build_norm(kind: str, hidden: int, eps: float, sequence_parallel: bool) -> nn.Module:
    """``RMSNorm`` (Llama) or ``LayerNorm`` (GPT), with init metadata on its parameters."""
    if kind == "RMSNorm":
        norm = RMSNorm(hidden, eps=eps)
    elif kind == "LayerNorm":
        norm = nn.LayerNorm(hidden, eps=eps)
        _replicated(norm.bias, ("zeros",), sequence_parallel)
    else:
        raise ValueError(f"unknown normalization {kind}")
    _replicated(norm.weight, ("ones",), sequence_parallel)
    return norm
