"""A test-only framework-buffer user: the MLP run in sequence chunks whose (tokens x ffn) intermediates live in
arena buffers, forward and backward (the pattern MsT/FPDT chunk buffers follow). tp=1, no bias. Put into a model
through the spec (``build_model(..., adjust_spec=with_toy_mlp)``), like any MLP class."""
from __future__ import annotations

import dataclasses

import torch

from megatron_lc.model.mlp import MLP


class _ChunkedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, mod):
        out = torch.empty(x.shape[:-1] + (w2.shape[0],), dtype=x.dtype, device=x.device)
        zs = []  # all chunks' buffers live at once, so an arena that aliased them would corrupt the result
        for lo, hi in mod.bounds(x.shape[0]):
            z = mod.arena.buffer("toy.fc1", (hi - lo,) + tuple(x.shape[1:-1]) + (w1.shape[0],), x.dtype,
                                 device=x.device)
            torch.matmul(x[lo:hi], w1.t(), out=z)
            zs.append(z)
        for (lo, hi), z in zip(mod.bounds(x.shape[0]), zs):
            torch.matmul(mod.activation(z), w2.t(), out=out[lo:hi])
        del zs, z
        one = mod.arena.buffer("toy.persist", (1,), x.dtype, device=x.device, persistent=True)  # a static buffer
        out.mul_(one.fill_(1.0))  # exact: x 1.0
        ctx.save_for_backward(x, w1, w2)
        ctx.mod = mod
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, w2 = ctx.saved_tensors
        mod = ctx.mod
        dx, dw1, dw2 = torch.empty_like(x), torch.zeros_like(w1), torch.zeros_like(w2)
        for lo, hi in mod.bounds(x.shape[0]):
            z = mod.arena.buffer("toy.fc1.bwd", (hi - lo,) + tuple(x.shape[1:-1]) + (w1.shape[0],), x.dtype,
                                 device=x.device)
            torch.matmul(x[lo:hi], w1.t(), out=z)
            with torch.enable_grad():
                zz = z.detach().requires_grad_(True)
                a = mod.activation(zz)
            gc = g[lo:hi]
            dw2 += gc.flatten(0, -2).t() @ a.detach().flatten(0, -2)
            (dz,) = torch.autograd.grad(a, zz, gc @ w2)
            dw1 += dz.flatten(0, -2).t() @ x[lo:hi].flatten(0, -2)
            dx[lo:hi] = dz @ w1
            del z, zz, a, dz
        return dx, dw1, dw2, None


class ArenaChunkedMLP(MLP):
    """``MLP`` (same parameters and names) whose fc1 output lives in 2 chunks of arena buffers."""

    chunks = 2

    def __init__(self, cfg, parts, output_std: float):
        super().__init__(cfg, parts, output_std)
        self.arena = parts.ctx.arena

    def bounds(self, s: int):
        step = -(-s // self.chunks)
        return [(lo, min(lo + step, s)) for lo in range(0, s, step)]

    def forward(self, x):
        return _ChunkedMLP.apply(x, self.linear_fc1.weight, self.linear_fc2.weight, self)


def with_toy_mlp(spec):
    """``adjust_spec`` that builds every layer's MLP as an ``ArenaChunkedMLP``."""
    return dataclasses.replace(spec, mlp=ArenaChunkedMLP)
