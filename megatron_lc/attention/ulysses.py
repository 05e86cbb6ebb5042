"""Ulysses attention (``cp_comm_type: a2a``) and its hybrid with ring (``a2a+p2p``, Ulysses inside, ring across).

Before attention one ``all_to_all_single`` over the Ulysses axis (U ranks) scatters heads and gathers the
sequence; after attention the inverse one scatters the sequence and gathers heads. Example U=2, 8 query heads,
sequence of 4 tokens, contiguous layout (a2a)::

    before:  rank 0 holds tokens 0-1, heads 0-7        rank 1 holds tokens 2-3, heads 0-7
    a2a  ->  rank 0 holds tokens 0-3, heads 0-3        rank 1 holds tokens 0-3, heads 4-7
    attention on the whole sequence for the local heads (causal, exact), then the inverse a2a.

q, k and v travel in one packed all-to-all (heads of each cut into U groups and concatenated per destination).

GQA: query head i uses kv head i // (nq / nkv). When nkv is not a multiple of U (e.g. nkv=2, U=4) the kv heads are
replicated ``rep = lcm(nkv, U) / nkv`` times (``config.layout.kv_replication``; ``replicate_kv`` here, whose
autograd sums the replicas' gradients back into the original head), so each rank receives the kv heads its query
heads use. FPDT's chunks use the same two functions.

The (out, lse) pair of the protocol (``core.py``) keeps the *local* out ``[s_l, b, nq, d]`` and the inner lse. Its
backward all-gathers q/k/v and out again (two all-to-alls recomputed, no attention) besides dout, then runs the
inner backward, then the inverse all-to-all of dq/dk/dv. Extra backward traffic per layer compared with the
autograd forward: ``(U-1)/U * s_l * b * d * e * (2 nq + 2 nkv')`` bytes (q, k, v and out), under ``a2a_bwd``.

Hybrid: the inner attention is ``RingAttention`` over the ring axis. The data layout gives ulysses rank u of ring
rank r the u-th contiguous piece of [chunk r | chunk 2R-1-r], so the gather of the a2a yields exactly ring rank r's
zigzag-local sequence. With ring size 1 the inner attention is plain local causal attention.

Bytes sent per rank and layer (U ranks, s_l local tokens, e bytes per element, nkv' = nkv * rep)::

    forward  (U-1)/U * s_l * b * d * e * (nq + 2 nkv')  [q,k,v]  +  (U-1)/U * s_l * b * d * e * nq  [out]
    backward the same (the gradients travel the inverse way)

recorded in ``topo.comm`` under the module's tag with ops ``a2a_fwd`` / ``a2a_bwd``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.topology import Axis, Topology
from .core import CoreAttention


def _a2a(send: torch.Tensor, topo: Topology, axis: Axis, op: str) -> torch.Tensor:
    """``send`` ``[U, ...]``: block u goes to axis rank u; returns ``[U, ...]`` with block u from axis rank u."""
    n = send.shape[0]
    send = send.contiguous()
    recv = torch.empty_like(send)
    topo.comm.add(op, (n - 1) / n * send.numel() * send.element_size())
    dist.all_to_all_single(recv, send, group=topo.group(axis))
    return recv


def gather_seq(x: torch.Tensor, topo: Topology, axis: Axis, op: str) -> torch.Tensor:
    """``[s, b, U, m, d]`` (m heads for each destination) -> ``[U*s, b, m, d]`` (sequence in axis-rank order)."""
    U = x.shape[2]
    recv = _a2a(x.permute(2, 0, 1, 3, 4), topo, axis, op)
    return recv.reshape(U * x.shape[0], *x.shape[1:2], *x.shape[3:])


def scatter_seq(y: torch.Tensor, topo: Topology, axis: Axis, op: str) -> torch.Tensor:
    """Inverse of ``gather_seq``: ``[U*s, b, m, d]`` -> ``[s, b, U, m, d]``."""
    U = topo.size(axis)
    recv = _a2a(y.view(U, y.shape[0] // U, *y.shape[1:]), topo, axis, op)
    return recv.permute(1, 2, 0, 3, 4)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topo, axis, tag):
        ctx.topo, ctx.axis, ctx.tag = topo, axis, tag
        with topo.comm.tag(tag):
            return gather_seq(x, topo, axis, "a2a_fwd")

    @staticmethod
    def backward(ctx, g):
        with ctx.topo.comm.tag(ctx.tag):
            return scatter_seq(g.contiguous(), ctx.topo, ctx.axis, "a2a_bwd"), None, None, None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topo, axis, tag):
        ctx.topo, ctx.axis, ctx.tag = topo, axis, tag
        with topo.comm.tag(tag):
            return scatter_seq(y, topo, axis, "a2a_fwd")

    @staticmethod
    def backward(ctx, g):
        with ctx.topo.comm.tag(ctx.tag):
            return gather_seq(g.contiguous(), ctx.topo, ctx.axis, "a2a_bwd"), None, None, None


def replicate_kv(k: torch.Tensor, v: torch.Tensor, rep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each kv head ``rep`` times in place along dim 2 (autograd sums the copies' gradients back)."""
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)


def sum_kv_replicas(g: torch.Tensor, rep: int) -> torch.Tensor:
    """Inverse of ``replicate_kv`` for a gradient ``[s, b, nkv*rep, d]``: the copies of each head summed."""
    if rep == 1:
        return g
    s, b, n, d = g.shape
    return g.view(s, b, n // rep, rep, d).sum(3)


class UlyssesAttention(CoreAttention):
    """q ``[s_l, b, nq, d]``, k/v ``[s_l, b, nkv, d]`` -> ``[s_l, b, nq, d]``; all-to-all over ``Axis.ULYSSES``
    around ``inner`` (local causal attention for a2a, ring attention over ``Axis.RING`` for a2a+p2p).
    ``kv_rep``: the layout's ``kv_replication`` for these head counts."""

    def __init__(self, topo: Topology, inner: CoreAttention, nq: int, nkv: int, kv_rep: int, tag: str = "attn"):
        super().__init__()
        self.topo, self.inner, self.tag = topo, inner, tag
        self.ulysses_size = topo.ulysses
        self.rep = kv_rep
        self.nq, self.nkv = nq, nkv

    def _packed(self, q, k, v):
        """q and the replicated k, v cut into U head groups per destination: ``[s, b, U, (nq+2nkv')/U, d]``."""
        s, b, nq, d = q.shape
        if nq != self.nq or k.shape[2] != self.nkv:
            raise ValueError(f"UlyssesAttention built for {self.nq}/{self.nkv} heads, got {nq}/{k.shape[2]}")
        k, v = replicate_kv(k, v, self.rep)
        U = self.ulysses_size
        return torch.cat([t.reshape(s, b, U, t.shape[2] // U, d) for t in (q, k, v)], dim=3)

    def _split(self, full):
        """The gathered ``[U*s, b, (nq+2nkv')/U, d]`` -> local-head q, k, v."""
        U, n_kv = self.ulysses_size, self.nkv * self.rep // self.ulysses_size
        return torch.split(full, [self.nq // U, n_kv, n_kv], dim=2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        s, b, nq, d = q.shape
        full = _GatherSeq.apply(self._packed(q, k, v), self.topo, Axis.ULYSSES, self.tag)  # [U*s, b, (nq+2nkv)/U, d]
        out = self.inner(*self._split(full), documents)  # [U*s, b, nq/U, d]; documents: full-sequence ids
        back = _ScatterSeq.apply(out.contiguous(), self.topo, Axis.ULYSSES, self.tag)  # [s, b, U, nq/U, d]
        return back.reshape(s, b, nq, d)

    def _gather_heads(self, t, op: str):
        s, b, n, d = t.shape
        return gather_seq(t.reshape(s, b, self.ulysses_size, n // self.ulysses_size, d), self.topo, Axis.ULYSSES, op)

    def forward_with_lse(self, q, k, v, documents=None):
        s, b, nq, d = q.shape
        with self.topo.comm.tag(self.tag):
            full = gather_seq(self._packed(q, k, v), self.topo, Axis.ULYSSES, "a2a_fwd")
            out_l, lse = self.inner.forward_with_lse(*(t.contiguous() for t in self._split(full)), documents)
            out = scatter_seq(out_l.contiguous(), self.topo, Axis.ULYSSES, "a2a_fwd").reshape(s, b, nq, d)
        return out, lse

    def backward_with_lse(self, dout, q, k, v, out, lse, documents=None):
        s, b, nq, d = q.shape
        with self.topo.comm.tag(self.tag):
            # each tensor dropped as soon as nothing needs it (these run at a re-run layer's peak)
            full = gather_seq(self._packed(q, k, v), self.topo, Axis.ULYSSES, "a2a_bwd")
            ql, kl, vl = (t.contiguous() for t in self._split(full))
            del full
            out_l = self._gather_heads(out, "a2a_bwd")
            dout_l = self._gather_heads(dout.contiguous(), "a2a_bwd")
            grads = self.inner.backward_with_lse(dout_l, ql, kl, vl, out_l, lse, documents)
            del ql, kl, vl, out_l, dout_l
            packed = torch.cat(grads, dim=2).contiguous()
            del grads
            back = scatter_seq(packed, self.topo, Axis.ULYSSES, "a2a_bwd")  # [s, b, U, m, d]
            del packed
        nkv_rep = self.nkv * self.rep
        U = self.ulysses_size
        dq, dk, dv = torch.split(back, [nq // U, nkv_rep // U, nkv_rep // U], dim=3)
        dk, dv = (sum_kv_replicas(t.reshape(s, b, nkv_rep, d), self.rep) for t in (dk, dv))
        return dq.reshape(s, b, nq, d), dk, dv
