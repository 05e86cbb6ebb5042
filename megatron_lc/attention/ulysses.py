"""Ulysses attention (``cp_comm_type: a2a``) and its hybrid with ring (``a2a+p2p``, Ulysses inside, ring across).

Before attention one ``all_to_all_single`` over the Ulysses axis (U ranks) scatters heads and gathers the
sequence; after attention the inverse one scatters the sequence and gathers heads. Example U=2, 8 query heads,
sequence of 4 tokens, contiguous layout (a2a)::

    before:  rank 0 holds tokens 0-1, heads 0-7        rank 1 holds tokens 2-3, heads 0-7
    a2a  ->  rank 0 holds tokens 0-3, heads 0-3        rank 1 holds tokens 0-3, heads 4-7
    attention on the whole sequence for the local heads (causal, exact), then the inverse a2a.

q, k and v travel in one packed all-to-all (heads of each cut into U groups and concatenated per destination).

GQA: query head i uses kv head i // (nq / nkv). When nkv is not a multiple of U (e.g. nkv=2, U=4) the kv heads are
replicated ``rep = lcm(nkv, U) / nkv`` times (``repeat_interleave``, whose autograd sums the replicas' gradients
back into the original head), so each rank receives the kv heads its query heads use. nq must be divisible by U
(``ConfigError`` otherwise).

Hybrid: the inner attention is ``RingAttention`` over the ring axis. The data layout gives ulysses rank u of ring
rank r the u-th contiguous piece of [chunk r | chunk 2R-1-r], so the gather of the a2a yields exactly ring rank r's
zigzag-local sequence. With ring size 1 the inner attention is plain local causal attention.

Bytes sent per rank and layer (U ranks, s_l local tokens, e bytes per element, nkv' = nkv * rep)::

    forward  (U-1)/U * s_l * b * d * e * (nq + 2 nkv')  [q,k,v]  +  (U-1)/U * s_l * b * d * e * nq  [out]
    backward the same (the gradients travel the inverse way)

recorded in ``topo.comm`` under the module's tag with ops ``a2a_fwd`` / ``a2a_bwd``.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..parallel.topology import Axis, Topology


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


def kv_replication(nq: int, nkv: int, ulysses: int) -> int:
    """How many times each kv head is replicated so U ranks each get whole GQA groups (1 when nkv % U == 0).

    >>> kv_replication(8, 2, 4)   # 2 kv heads, 4 ranks: each kv head twice -> 4 kv heads, one per rank
    2
    """
    if nq % ulysses != 0:
        raise ConfigError(f"attention heads per tp rank ({nq}) must be divisible by ulysses size ({ulysses})")
    if nq % nkv != 0:
        raise ConfigError(f"attention heads ({nq}) must be divisible by kv heads ({nkv})")
    return math.lcm(nkv, ulysses) // nkv


class UlyssesAttention(nn.Module):
    """q ``[s_l, b, nq, d]``, k/v ``[s_l, b, nkv, d]`` -> ``[s_l, b, nq, d]``; all-to-all over ``Axis.ULYSSES``
    around ``inner`` (local causal attention for a2a, ring attention over ``Axis.RING`` for a2a+p2p)."""

    def __init__(self, topo: Topology, inner: nn.Module, nq: int, nkv: int, tag: str = "attn"):
        super().__init__()
        self.topo, self.inner, self.tag = topo, inner, tag
        self.U = topo.ulysses
        self.rep = kv_replication(nq, nkv, self.U)
        self.nq, self.nkv = nq, nkv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b, nq, d = q.shape
        if nq != self.nq or k.shape[2] != self.nkv:
            raise ValueError(f"UlyssesAttention built for {self.nq}/{self.nkv} heads, got {nq}/{k.shape[2]}")
        U = self.U
        if self.rep > 1:
            k, v = k.repeat_interleave(self.rep, dim=2), v.repeat_interleave(self.rep, dim=2)
        nkv = k.shape[2]
        packed = torch.cat([t.reshape(s, b, U, t.shape[2] // U, d) for t in (q, k, v)], dim=3)
        full = _GatherSeq.apply(packed, self.topo, Axis.ULYSSES, self.tag)  # [U*s, b, (nq+2nkv)/U, d]
        ql, kl, vl = torch.split(full, [nq // U, nkv // U, nkv // U], dim=2)
        out = self.inner(ql, kl, vl)  # [U*s, b, nq/U, d]
        back = _ScatterSeq.apply(out.contiguous(), self.topo, Axis.ULYSSES, self.tag)  # [s, b, U, nq/U, d]
        return back.reshape(s, b, nq, d)
