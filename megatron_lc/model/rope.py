"""Rotary position embedding (non-interleaved halves, as Llama / Hugging Face / Megatron's default), with the
Hugging Face scaling types ``linear``, ``llama3`` and ``yarn`` (``model.rope_scaling``, fields named as in a
Hugging Face ``config.json``; the valid fields are in ``config/model.py``).

    inv_freq_i = 1 / base^(2i/d)                                              default
    linear:  inv_freq_i / factor                                              (position interpolation)
    llama3:  long wavelengths (> original / low_freq_factor) divided by factor, short ones (< original /
             high_freq_factor) kept, smooth interpolation between                (Llama 3.1)
    yarn:    per-dimension blend of interpolated (/ factor) and original frequencies over the correction range
             [beta_fast, beta_slow] rotations, and cos/sin scaled by the attention factor 0.1 ln(factor) + 1 (YaRN)

Frequencies are computed in float64 and rounded to float32 once (Hugging Face computes them in float32: they agree
to ~1e-7 relative, ``tests/model/test_rope_scaling.py``)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s: dict) -> tuple[torch.Tensor, float]:
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        attention = (mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
                     if s.get("mscale") and s.get("mscale_all_dim") else mscale(factor))

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, original = float(s["factor"]), float(s["original_max_position_embeddings"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope_frequencies(dim: int, base: float, scaling: Optional[dict] = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies ``[dim/2]`` float32, attention factor) for ``model.rotary_base`` and ``rope_scaling``."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    kind = (scaling or {}).get("rope_type", "default")
    attention = 1.0
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, attention = _yarn(inv_freq, dim, base, scaling)
    elif kind != "default":
        raise ValueError(f"unknown rope_type {kind!r}")  # config/model.py refuses it first
    return inv_freq.float(), attention


class RotaryEmbedding(nn.Module):
    """``cos, sin = rope(position_ids)`` for per-token positions ``[s, b]`` -> ``[s, b, 1, d]`` each (fp32).

    Positions come from the data path, so any sequence layout (zigzag, strided) gets the right angles."""

    def __init__(self, dim: int, base: float, scaling: Optional[dict] = None):
        super().__init__()
        self.dim, self.base, self.scaling = dim, base, scaling
        inv_freq, self.attention_factor = rope_frequencies(dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        """The frequencies again (on the host, as at construction), moved to ``device``: for a model built on the
        meta device (``model/init.materialize``)."""
        with torch.device("cpu"):
            self.inv_freq = rope_frequencies(self.dim, self.base, self.scaling)[0].to(device)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(position_ids.device)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(-2)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """x: ``[s, b, n, d]``; cos/sin: ``[s, b, 1, d]`` (fp32). ``x·cos + rotate_half(x)·sin`` in fp32, back in x's
    dtype, written half by half into one fp32 buffer -- ``x1·c1 − x2·s1``, ``x2·c2 + x1·s2``: the formula's numbers
    bit for bit (x·cos promotes x exactly; adding a negated product is subtracting it) -- so at most 1.5 x-sized
    fp32 tensors exist at once, not the formula's 3.5 (two upcasts of x, -x2, rotate_half(x), the products): at one
    GPU and 512K tokens, q's temporaries are 12 GiB instead of 28. ``scale`` multiplies the result in the same
    buffer before the cast (the query scale of ``model.softmax_scale``: no tensor more)."""
    h = x.shape[-1] // 2
    out = x * cos
    out[..., :h].sub_(x[..., h:] * sin[..., :h])
    out[..., h:].add_(x[..., :h] * sin[..., h:])
    if scale != 1.0:
        out.mul_(scale)
    return out.to(x.dtype)
