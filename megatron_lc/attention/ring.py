"""Ring attention (``cp_comm_type: p2p``): causal, zigzag load-balanced, exact forward and backward.

Layout (``parallel/token_layout.py``): the sequence is cut into ``2R`` equal chunks; ring rank r holds chunks r and
2R-1-r, in that order (its "front" and "back" halves, c tokens each). Example R=4, 8 chunks::

    ring rank:   0        1        2        3
    holds:     [0 | 7]  [1 | 6]  [2 | 5]  [3 | 4]

k/v travel around the ring (rank r sends to r+1, receives from r-1). At step i rank r holds the k/v of rank
j = (r - i) mod R and computes one block, always half the work of a full one:

    i == 0 (own k/v)   causal attention of the local 2c queries on the local 2c keys (front < back in position)
    j <  r             all 2c queries x the front c keys of j (chunk j precedes both of r's chunks; chunk
                       2R-1-j follows both)
    j >  r             the back c queries x all 2c keys of j (chunk r precedes everything of j)

Partial results are merged by log-sum-exp in fp32 (``merge.py``). The next k/v transfer
(``dist.batch_isend_irecv``) is issued before the current block is computed, so it overlaps compute.

Backward re-circulates k/v the same way; each rank computes the block gradients with the *merged* out and lse
(exact: P_block = exp(S_block - lse_total)). dq stays local; the dk/dv of a foreign block travel with an
accumulator that starts at the first rank that used them (j+1) and reaches the owner j after R-1 hops, where it
is added to the owner's own diagonal-block gradient. Bytes sent per rank and layer (K = bytes of one local k+v)::

    forward  (R-1) * K                  backward (R-1) * K  +  (R-1) * K_fp32   (dk/dv accumulated in fp32)

Bytes are recorded in ``topo.comm`` under the module's tag with ops ``p2p_fwd`` / ``p2p_bwd``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError
from ..parallel.collectives import count_send
from ..parallel.token_layout import zigzag_index
from ..parallel.topology import Axis, Topology
from .backends import Kernels
from .core import CoreAttention, to_bnsd, to_sbnd
from .masks import overlap, select, visible
from .merge import merge

KV_TAG, DKV_TAG = 11, 12  # distinct p2p tags: k/v and dk/dv transfers between the same two ranks overlap


class _Pending:
    """An in-flight ``send_recv``; ``wait()`` returns the received tensor."""

    def __init__(self, works, sent: torch.Tensor, buf: torch.Tensor):
        self.works, self.sent, self.buf = works, sent, buf  # ``sent`` kept alive until the send completes

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.sent = None
        return self.buf


class RingComm:
    """Send to the next ring rank and receive from the previous one, asynchronously, counting bytes sent.

    Ring of global ranks ``topo.ranks(axis)``; e.g. hybrid cp=4 (ring 2 x ulysses 2) on ranks 0..3: ring groups
    [0, 2] and [1, 3], so rank 2's next and previous are both rank 0."""

    def __init__(self, topo: Topology, axis: Axis = Axis.RING):
        self.topo, self.axis = topo, axis
        self.size = topo.size(axis)
        self.rank = topo.axis_rank(axis)
        self.group = self.next = self.prev = None
        if self.size > 1:
            ranks = topo.ranks(axis)
            self.group = topo.group(axis)
            self.next, self.prev = ranks[(self.rank + 1) % self.size], ranks[(self.rank - 1) % self.size]

    def send_recv(self, t: torch.Tensor, tag: int, op: str) -> _Pending:
        """Post ``isend(t -> next)`` and ``irecv(<- prev)`` of the same shape; returns the pending transfer."""
        t = t.contiguous()
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, group=self.group, tag=tag),
               dist.P2POp(dist.irecv, buf, self.prev, group=self.group, tag=tag)]
        count_send(self.topo, t.numel() * t.element_size(), op)
        return _Pending(dist.batch_isend_irecv(ops), t, buf)


def _block_masks(docs: Optional[list], r: int, j: int, c: int):
    """Document masks of step j's block on ring rank r (see module doc for the three cases); (None, True) without
    documents; ``(mask, False)`` when no query of the block sees a key (the block is skipped)."""
    if docs is None:
        return None, True
    if j == r:
        dq, dk = docs[r], docs[r]
    elif j < r:
        dq, dk = docs[r], docs[j][:, :c]
    else:
        dq, dk = docs[r][:, c:], docs[j]
    return visible(dq, dk), j == r or overlap(dq, dk)


def ring_forward(q, k, v, comm: RingComm, backend, scale: Optional[float] = None, docs: Optional[list] = None):
    """Forward of ring attention on zigzag-local tensors ``[b, n, 2c, d]``; returns fp32 (out, lse). ``docs``: the
    document ids of every ring rank's local tokens (``masks.py``), or None."""
    R, r = comm.size, comm.rank
    c = q.shape[2] // 2
    mask, _ = _block_masks(docs, r, r, c)
    out, lse = backend.forward(q, k, v, True, scale, visible=mask)  # step 0: own k/v, causal on the local order
    out, lse = out.float(), lse.float()
    if R == 1:
        return out, lse
    q_back = q[:, :, c:].contiguous()
    kv = torch.stack([k, v])
    pending = comm.send_recv(kv, KV_TAG, "p2p_fwd")
    for i in range(1, R):
        kv = pending.wait()
        if i + 1 < R:
            pending = comm.send_recv(kv, KV_TAG, "p2p_fwd")  # next transfer in flight during this block
        j = (r - i) % R
        mask, seen = _block_masks(docs, r, j, c)
        if not seen:  # no query of this block shares a document with its keys
            continue
        if j < r:  # all queries x front keys of j
            o, l = backend.forward(q, kv[0, :, :, :c].contiguous(), kv[1, :, :, :c].contiguous(), False, scale,
                                   visible=mask)
            out, lse = merge(out, lse, o, l)
        else:  # back queries x all keys of j
            o, l = backend.forward(q_back, kv[0], kv[1], False, scale, visible=mask)
            ob, lb = merge(out[:, :, c:], lse[:, :, c:], o, l)
            out, lse = torch.cat([out[:, :, :c], ob], dim=2), torch.cat([lse[:, :, :c], lb], dim=2)
            del ob, lb
        del o, l  # merged: not held through the next block's kernel
    return out, lse


def ring_backward(dout, q, k, v, out, lse, comm: RingComm, backend, scale: Optional[float] = None,
                  docs: Optional[list] = None):
    """Backward of ``ring_forward`` given the merged ``out`` and ``lse``; returns dq, dk, dv in input dtypes."""
    R, r = comm.size, comm.rank
    c = q.shape[2] // 2
    mask, _ = _block_masks(docs, r, r, c)
    dq0, dk0, dv0 = backend.backward(dout, q, k, v, out, lse, True, scale, visible=mask)
    if R == 1:
        return dq0, dk0, dv0
    dq = dq0.float()
    own = torch.stack([dk0, dv0]).float()
    del dq0, dk0, dv0  # (under bf16 their fp32 copies above are what stays)
    back = (dout[:, :, c:].contiguous(), q[:, :, c:].contiguous(), out[:, :, c:].contiguous(),
            lse[:, :, c:].contiguous())
    kv = torch.stack([k, v])
    pending_kv = comm.send_recv(kv, KV_TAG, "p2p_bwd")
    pending_dkv = None
    for i in range(1, R):
        kv = pending_kv.wait()
        if i + 1 < R:
            pending_kv = comm.send_recv(kv, KV_TAG, "p2p_bwd")
        j = (r - i) % R
        mask, seen = _block_masks(docs, r, j, c)
        if not seen:  # nothing of this block was seen: j's dk/dv accumulator passes through unchanged
            blk = torch.zeros_like(kv, dtype=torch.float32)
        elif j < r:
            kf, vf = kv[0, :, :, :c].contiguous(), kv[1, :, :, :c].contiguous()
            dq_, dk_, dv_ = backend.backward(dout, q, kf, vf, out, lse, False, scale, visible=mask)
            del kf, vf
            dq += dq_.float()
            blk = F.pad(torch.stack([dk_, dv_]).float(), (0, 0, 0, c))  # zero grads for j's back chunk
            del dq_, dk_, dv_  # accumulated: not held through the next block's kernel
        else:
            dq_, dk_, dv_ = backend.backward(back[0], back[1], kv[0], kv[1], back[2], back[3], False, scale,
                                             visible=mask)
            dq[:, :, c:] += dq_.float()
            blk = torch.stack([dk_, dv_]).float()
            del dq_, dk_, dv_
        if pending_dkv is not None:
            blk = blk + pending_dkv.wait()  # accumulator of j's dk/dv from the ranks before this one
        pending_dkv = comm.send_recv(blk, DKV_TAG, "p2p_bwd")  # after step R-1 it reaches its owner
    own = own + pending_dkv.wait()
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class RingAttnFunction(torch.autograd.Function):
    """q ``[b, nq, 2c, d]``, k/v ``[b, nkv, 2c, d]`` (zigzag-local order) -> out ``[b, nq, 2c, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, comm: RingComm, backend, tag: str, scale: Optional[float], docs: Optional[list]):
        ctx.comm, ctx.backend, ctx.tag, ctx.scale, ctx.docs = comm, backend, tag, scale, docs
        with comm.topo.comm.tag(tag):
            out, lse = ring_forward(q, k, v, comm, backend, scale, docs)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with ctx.comm.topo.comm.tag(ctx.tag):
            dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.comm, ctx.backend, ctx.scale,
                                       ctx.docs)
        return dq, dk, dv, None, None, None, None, None


class RingAttention(CoreAttention):
    """Core attention over the ring axis: q/k/v ``[s_local, b, n, d]`` (zigzag-local order) -> ``[s_local, b, nq, d]``.

    With a ring of size 1 this is plain causal attention through the chosen kernel (used by Ulysses when
    cp_comm_type is a2a)."""

    def __init__(self, topo: Topology, backend="auto", tag: str = "attn", axis: Axis = Axis.RING):
        super().__init__()
        self.tag = tag
        self.kernels = Kernels.of(backend)
        self.comm = RingComm(topo, axis)

    def _check_length(self, s: int) -> None:
        if self.comm.size > 1 and s % 2 != 0:
            raise ConfigError(f"ring attention: local sequence length ({s}) must be even (two zigzag chunks per "
                              f"rank, ring size {self.comm.size}); the full sequence must be divisible by "
                              f"{2 * self.comm.size} x ulysses size")

    def ring_documents(self, documents: Optional[torch.Tensor]) -> Optional[list]:
        """The document ids of every ring rank's zigzag part of the full sequence (a ring of size 1: in order)."""
        if documents is None:
            return None
        s, R = documents.shape[1], self.comm.size
        if R == 1:
            return [documents]
        return [select(documents, zigzag_index(s, R, j)) for j in range(R)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        self._check_length(q.shape[0])
        q_, k_, v_ = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))  # [b, n, s, d]
        out = RingAttnFunction.apply(q_, k_, v_, self.comm, self.kernels(q.device), self.tag, None,
                                     self.ring_documents(documents))
        return out.permute(2, 0, 1, 3)

    def forward_with_lse(self, q, k, v, documents=None):
        """The traffic of ``forward`` (same ops, same byte counters); lse ``[b, nq, s_local]`` fp32."""
        self._check_length(q.shape[0])
        with self.comm.topo.comm.tag(self.tag):
            out, lse = ring_forward(to_bnsd(q), to_bnsd(k), to_bnsd(v), self.comm, self.kernels(q.device),
                                    docs=self.ring_documents(documents))
        return to_sbnd(out.to(q.dtype)), lse

    def backward_with_lse(self, dout, q, k, v, out, lse, documents=None):
        with self.comm.topo.comm.tag(self.tag):
            dq, dk, dv = ring_backward(to_bnsd(dout), to_bnsd(q), to_bnsd(k), to_bnsd(v), to_bnsd(out), lse,
                                       self.comm, self.kernels(q.device), docs=self.ring_documents(documents))
        return to_sbnd(dq), to_sbnd(dk), to_sbnd(dv)
