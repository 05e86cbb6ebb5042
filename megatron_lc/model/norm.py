"""Normalisation layers; their weights are replicated over tp (grads all-reduced over tp under SP).

``RMSNorm`` saves what a fused kernel saves -- the input and one ``rstd`` per token -- on every device. On CUDA it
calls ``F.rms_norm`` (torch's fused kernel, which saves input + rstd; never executed here) in the input's dtype, the
weight cast to it and outside autocast, as the CPU twin computes. On CPU ``F.rms_norm`` is a
composite of pow/mean/rsqrt/mul whose autograd also keeps the normalised ``x * rstd`` (one more hidden-sized tensor
per norm, 1 KiB a token for h = 256 in fp32), so the CPU twin is a small autograd function with the fused kernel's
saved set and the composite's arithmetic (upcast, normalise, cast back, then scale by the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.tensor_parallel import replicated_parameter


RMS_NORM_SLICE_ELEMS = 1 << 24  # elements of x per slice of the CPU backward (64 MiB of fp32)


class _RMSNormFunction(torch.autograd.Function):
    """y = (x·rstd).to(x.dtype) · w, rstd = 1/sqrt(mean(x², -1) + eps) in fp32 (or x's dtype if wider). Saves x and
    rstd. Backward runs over slices along dim 0 of about ``RMS_NORM_SLICE_ELEMS`` elements: beside the input grad it
    holds x·rstd and the incoming grad times it for those rows only (as torch's fused CUDA kernel holds nothing the
    size of x), e.g. hidden 4096, 131,072 fp32 rows: 2 x 64 MiB of temporaries, not 2 x 2 GiB. Each row's
    arithmetic is the same whatever the slice, so dx is too; dweight sums the slices' partial sums in fp32."""

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
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_x else None
        dweight = None
        in_place = need_x and x.dtype == rstd.dtype == weight.dtype and g.dtype == x.dtype
        step = max(1, RMS_NORM_SLICE_ELEMS // max(1, x[:1].numel()))  # along dim 0: views, whatever g's strides
        for i in range(0, x.shape[0], step):
            xs, gs, rs = x[i:i + step], g[i:i + step], rstd[i:i + step]
            n = xs.to(rs.dtype) * rs  # normalised x, fp32
            if need_w:
                part = (gs * n.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32)
                dweight = part if dweight is None else dweight.add_(part)
            if need_x:
                # in x's dtype where that is rstd's (an fp32 residual): the slice of dx itself, else an fp32 temporary
                gn = torch.mul(gs, weight, out=dx[i:i + step]) if in_place else (gs * weight).to(rs.dtype)
                dot = (gn * n).mean(-1, keepdim=True)
                gn.sub_(n.mul_(dot)).mul_(rs)
                if not in_place:
                    dx[i:i + step] = gn
            del n
        if dweight is not None:
            dweight = dweight.to(weight.dtype)
        return dx, dweight, None


def uses_fused_kernel(x: torch.Tensor) -> bool:
    """torch's fused ``F.rms_norm`` on CUDA; the CPU twin (``_RMSNormFunction``) elsewhere, a rehearsal's stand-in
    device included (its memory is the fused kernel's)."""
    return x.is_cuda


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class RMSNorm(nn.Module):
    """Drop-in for ``nn.RMSNorm(hidden, eps)`` (same parameter name ``weight``, same values), saving only input + rstd
    for backward on every device. It scales by ``weight``; ``ZeroCenteredRMSNorm`` by ``1 + weight``."""

    scale_offset = 0.0  # 1.0: the scale is 1 + weight (ZeroCenteredRMSNorm)

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.normalized_shape = (hidden,)
        self.eps = eps
        self.weight = nn.Parameter(torch.full((hidden,), 1.0 - self.scale_offset))

    def scale(self) -> torch.Tensor:
        """What the normalised input is multiplied by: the weight, or ``1 + weight`` summed in fp32 (as Hugging
        Face's Gemma sums it). A graph node: its gradient is the weight's."""
        return self.weight.float() + self.scale_offset if self.scale_offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_fused_kernel(x):  # torch's fused kernel (GPU only, never executed here)
            # in x's dtype, as the CPU twin: the weight cast to it (FSDP2 gathers it in bf16 beside an fp32
            # residual, and torch's fused kernel takes one dtype: else a composite with an fp32 copy of x), and
            # outside autocast (whose fp32 rule for rms_norm would copy a bf16 residual to fp32)
            with torch.autocast(x.device.type, enabled=False):
                return F.rms_norm(x, self.normalized_shape, self.scale().to(x.dtype), self.eps)
        if torch.is_autocast_enabled(x.device.type):  # the norm runs in the input's dtype
            with torch.autocast(x.device.type, enabled=False):
                return _RMSNormFunction.apply(x, self.scale().to(x.dtype), self.eps)
        return _RMSNormFunction.apply(x, self.scale(), self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}" + (", scale 1 + weight" if self.scale_offset else "")


class ZeroCenteredRMSNorm(RMSNorm):
    """``RMSNorm`` scaling by ``1 + weight``, the weight starting at 0 (``model.apply_layernorm_1p``, Gemma's norm).
    Hugging Face's Gemma checkpoints store the same zero-centred weight: import and export copy it as it is. In
    fp32 the output is Hugging Face's bit for bit; in bf16 the product is rounded after the cast of the normalised
    input (Llama's order; Hugging Face's Gemma casts after the product): one rounding apart."""

    scale_offset = 1.0


# the norm classes by ``norm_kind``: the spec's ``norm`` entry
NORMS = {"RMSNorm": RMSNorm, "RMSNorm1p": ZeroCenteredRMSNorm, "LayerNorm": nn.LayerNorm}


def norm_kind(normalization: str, apply_1p: bool) -> str:
    """The key of ``NORMS``: ``model.normalization``, or ``RMSNorm1p`` with ``model.apply_layernorm_1p``."""
    return "RMSNorm1p" if apply_1p and normalization == "RMSNorm" else normalization


def build_norm(kind: str, hidden: int, eps: float, grads_partial_over_tp: bool) -> nn.Module:
    """A norm of ``NORMS[kind]`` with init metadata on its parameters. ``grads_partial_over_tp``: each tp rank's
    gradient of the weight is a partial sum, all-reduced over tp by ``training/optimizer.sync_gradients`` (the
    hidden-size norms under sequence parallelism; the per-head q/k norms under any tp > 1: each rank's heads)."""
    if kind not in NORMS:
        raise ValueError(f"unknown normalization {kind}")
    norm = NORMS[kind](hidden, eps=eps)
    if kind == "LayerNorm":
        replicated_parameter(norm.bias, ("zeros",), grads_partial_over_tp)
    replicated_parameter(norm.weight, ("zeros",) if kind == "RMSNorm1p" else ("ones",), grads_partial_over_tp)
    return norm
