"""MsT autograd functions: the mini-sequence MLP here, the LM head + cross entropy in ``head_function.py``.

Both work on token rows ``[N, h]`` (the ``[s, b]`` token grid flattened, s-major) and cut them into chunks of
``chunk`` rows; the last chunk holds the remainder (N = 4100, chunk = 1024 -> 1024, 1024, 1024, 1024, 4), so no
token is ever dropped. The big intermediates -- ``[n, ffn]`` for the MLP, ``[n, V/tp]`` logits for the head -- exist
for one chunk at a time, in forward and in backward (the MLP recomputes its chunk's ``[n, ffn]`` in backward, MsT
Appendix B, Algorithm 3). Weight gradients are summed over the chunks and *returned* from ``backward``; autograd
accumulates them into ``.grad`` like any other gradient. (MsT's reference code writes ``weight.grad`` by hand
outside autograd: that skips gradient hooks, ignores ``torch.autograd.grad`` and breaks when ``.grad`` is None or
being accumulated over micro-batches by autograd itself.)

Communication stays outside: the tp/SP input mapping (all-gather or copy) and output mapping (reduce-scatter or
all-reduce) are applied by the modules in ``modules.py`` on whole tensors, so these functions return *partial* input
gradients under tp, exactly like ``F.linear`` in the unchunked column/row linears.

Mixed precision: under autocast the matmuls run in the autocast dtype, the saved input is kept in it (what the
unchunked linears keep), weight gradients are accumulated in fp32 -- also when FSDP2 hands the functions bf16
weights -- and returned in the weight's dtype (``grad_accumulator``); tested with CPU bf16 autocast and bf16
weights, never run on a GPU.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable
import torch.nn.functional as F

from ...model.mlp import activate, activate_with_grad_fn


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(0, c), (c, 2c), ..., (k*c, n)]``: every row in exactly one chunk, the last one possibly shorter."""
    chunk = max(1, int(chunk))
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the chunks compute in: autocast's on ``x``'s device when it is on (bf16 on a GPU), else ``x``'s."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def cast_to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype`` (no copy when it already is; None stays None)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def grad_accumulator(w: torch.Tensor) -> torch.Tensor:
    """Zeros for the sum of ``w``'s per-chunk gradients, in float32 when ``w`` is bf16 / fp16 (FSDP2 gathers the
    weights in the autocast dtype): 32 chunk partials summed in bf16 lose about 3 of its 8 bits; summed in fp32 and
    cast once (``as_grad``) the result is as exact as the unchunked linear's one bf16 rounding."""
    dtype = torch.float32 if w.dtype in (torch.bfloat16, torch.float16) else w.dtype
    return torch.zeros(w.shape, dtype=dtype, device=w.device)


def as_grad(acc: Optional[torch.Tensor], w: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The accumulated gradient in ``w``'s dtype, as autograd expects it (one cast; none when already)."""
    return None if acc is None else cast_to(acc, w.dtype)


def accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in acc's dtype (fp32 even when a, b are bf16: the chunk's product is rounded once, as the
    unchunked linear's, and summed in fp32)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:  # GPU mixed precision only
        acc.add_(a.mm(b))


# ---- MLP ----------------------------------------------------------------------------------------------------------
# the activations are the plain MLP's own (``model/mlp.py``: SwiGLU, GeGLU, GeLU), so both compute the same numbers


class _MiniSequenceMLP(torch.autograd.Function):
    """``act(x W1^T + b1) W2^T`` over row chunks. x ``[N, h]``, W1 ``[f1, h]`` (f1 = 2f gated: local
    ``[gate; up]``), b1 ``[f1]`` or None, W2 ``[h_out, f]``. Returns ``[N, h_out]`` (a partial sum under tp; the
    row linear's reduction and bias are applied by the caller)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, kind: str, chunk: int):
        dtype = compute_dtype(x)
        ctx.dtype, ctx.kind, ctx.chunk, ctx.x_dtype = dtype, kind, chunk, x.dtype
        with torch.autocast(x.device.type, enabled=False):
            xc_, w1c, b1c, w2c = cast_to(x, dtype), cast_to(w1, dtype), cast_to(b1, dtype), cast_to(w2, dtype)
            # the input in the compute dtype, as the unchunked linear keeps it (bf16 under autocast, not fp32)
            ctx.save_for_backward(xc_, w1, b1, w2)
            out = torch.empty(x.shape[0], w2.shape[0], dtype=dtype, device=x.device)
            for i0, i1 in chunk_bounds(x.shape[0], chunk):
                a = activate(F.linear(xc_[i0:i1], w1c, b1c), kind)
                torch.mm(a, w2c.t(), out=out[i0:i1])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, w1, b1, w2 = ctx.saved_tensors  # x already in the compute dtype
        dtype, kind = ctx.dtype, ctx.kind
        need_x = ctx.needs_input_grad[0]
        dx = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device) if need_x else None
        dw1 = grad_accumulator(w1) if ctx.needs_input_grad[1] else None
        db1 = grad_accumulator(b1) if b1 is not None and ctx.needs_input_grad[2] else None
        dw2 = grad_accumulator(w2) if ctx.needs_input_grad[3] else None
        with torch.autocast(x.device.type, enabled=False):
            xc_, w1c, b1c, w2c = cast_to(x, dtype), cast_to(w1, dtype), cast_to(b1, dtype), cast_to(w2, dtype)
            g = cast_to(g, dtype)
            for i0, i1 in chunk_bounds(x.shape[0], ctx.chunk):
                xi, gi = xc_[i0:i1], g[i0:i1]
                h = F.linear(xi, w1c, b1c)  # recomputed: [n, f1] lives for this chunk only
                a, act_grad = activate_with_grad_fn(h, kind)
                if dw2 is not None:
                    accumulate_mm(dw2, gi.t(), a)
                del a
                dh = act_grad(gi.mm(w2c))
                del h, act_grad
                if dw1 is not None:
                    accumulate_mm(dw1, dh.t(), xi)
                if db1 is not None:
                    db1.add_(dh.sum(dim=0).to(db1.dtype))
                if need_x:
                    dx[i0:i1] = dh.mm(w1c)
        return dx, as_grad(dw1, w1), as_grad(db1, b1), as_grad(dw2, w2), None, None


def mini_sequence_mlp(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                      kind: str, chunk: int) -> torch.Tensor:
    """MLP without its tp communication and output bias, over chunks of ``chunk`` rows of ``x [N, h]``; ``kind``:
    the activation (``model.mlp.ACTIVATIONS``)."""
    return _MiniSequenceMLP.apply(x, w1, b1, w2, kind, chunk)
