"""A block's rectangles (``ranges.py``) through a dense kernel, one call per rectangle, with no mask: the exact
decomposition every kernel without a variable-length entry point takes (the CPU's fused kernel, ``math``).

    out, lse = rects_forward(kernel, q, k, v, rects)              # fp32; rows no rectangle covers: 0, -inf
    dq, dk, dv = rects_backward(kernel, dout, q, k, v, out, lse, rects)   # fp32, from the merged out and lse

FULL rectangles call the kernel with ``causal=False``, CAUSAL squares with ``causal=True``, ANTI squares with
``causal=True`` on their queries and keys reversed (query p sees keys p..m-1 exactly when, reversed, it sees keys
0..p) and the results reversed back: a copy of the square's q, k, v rows, never a mask. Partial results of a query
row merge by their log-sum-exp in fp32 (``merge.py``), in place in the accumulators; the backward of each
rectangle uses the *merged* out and lse (P = exp(S - lse), exact for any cut of the keys) and adds its dq, dk, dv
into fp32 accumulators. Every tensor here is a rectangle's rows or the block's own q/k/v/out shapes: working memory
O(block), nothing with a query and a key dimension.

Example: documents of 3 and 5 tokens in one 8-token block are 2 calls (CAUSAL 3x3, CAUSAL 5x5); a window of 2 over
6 tokens is 5 calls (``ranges.py``'s band), each at most W x W.
"""
from __future__ import annotations

from typing import Optional

import torch

from .merge import merge_into
from .ranges import ANTI, FULL


def _rows(t: torch.Tensor, row: Optional[int], lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``t`` ``[b, n, s, ...]`` (dim 2), of one batch row or all: a view."""
    t = t[:, :, lo:hi] if row is None else t[row:row + 1, :, lo:hi]
    return t


def _rev(t: torch.Tensor) -> torch.Tensor:
    return torch.flip(t, dims=(2,))


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The accumulators of a block no key was seen in yet: out 0 ``[b, nq, s, d]``, lse -inf ``[b, nq, s]``, fp32."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)


def rects_forward(kernel, q, k, v, rects, scale: Optional[float] = None, acc=None):
    """(out, lse) of queries ``q [b, nq, sq, d]`` over keys ``k, v [b, nkv, sk, d]`` restricted to ``rects``,
    merged into ``acc`` (fp32 out, lse; modified in place) or fresh accumulators."""
    out, lse = acc if acc is not None else empty_result(q)
    for r in rects:
        qs, ks, vs = _rows(q, r.row, r.q0, r.q1), _rows(k, r.row, r.k0, r.k1), _rows(v, r.row, r.k0, r.k1)
        if r.kind == ANTI:
            qs, ks, vs = _rev(qs), _rev(ks), _rev(vs)
        o, l = kernel.forward(qs, ks, vs, r.kind != FULL, scale)
        if r.kind == ANTI:
            o, l = _rev(o), torch.flip(l, dims=(2,))
        merge_into(_rows(out, r.row, r.q0, r.q1), _rows(lse, r.row, r.q0, r.q1), o, l.float())
        del o, l, qs, ks, vs
    return out, lse


def rects_backward(kernel, dout, q, k, v, out, lse, rects, scale: Optional[float] = None, grads=None):
    """dq, dk, dv (fp32, q's and k's shapes) of ``rects_forward``'s rectangles from the merged ``out`` and ``lse``,
    added into ``grads`` (fp32 accumulators, modified in place) or fresh zeros."""
    if grads is None:
        grads = (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                 torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                 torch.zeros(v.shape, dtype=torch.float32, device=v.device))
    dq, dk, dv = grads
    for r in rects:
        qside = [_rows(t, r.row, r.q0, r.q1) for t in (dout, q, out)]
        ls = lse[:, :, r.q0:r.q1] if r.row is None else lse[r.row:r.row + 1, :, r.q0:r.q1]
        ks, vs = _rows(k, r.row, r.k0, r.k1), _rows(v, r.row, r.k0, r.k1)
        if r.kind == ANTI:
            qside, ks, vs, ls = [_rev(t) for t in qside], _rev(ks), _rev(vs), torch.flip(ls, dims=(2,))
        gq, gk, gv = kernel.backward(qside[0], qside[1], ks, vs, qside[2], ls.contiguous(), r.kind != FULL, scale)
        if r.kind == ANTI:
            gq, gk, gv = _rev(gq), _rev(gk), _rev(gv)
        _rows(dq, r.row, r.q0, r.q1).add_(gq)
        _rows(dk, r.row, r.k0, r.k1).add_(gk)
        _rows(dv, r.row, r.k0, r.k1).add_(gv)
        del gq, gk, gv, qside, ks, vs, ls
    return dq, dk, dv


class ByRectangles:
    """The rectangles' calls of a dense kernel (mixed into the backends without a variable-length kernel)."""

    def forward_rects(self, q, k, v, rects, scale: Optional[float] = None, acc=None):
        return rects_forward(self, q, k, v, rects, scale, acc)

    def backward_rects(self, dout, q, k, v, out, lse, rects, scale: Optional[float] = None, grads=None):
        return rects_backward(self, dout, q, k, v, out, lse, rects, scale, grads)


__all__ = ["ByRectangles", "empty_result", "rects_backward", "rects_forward"]
