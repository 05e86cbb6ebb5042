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
(``dist.batch_isend_irecv``) is issued before the current block is computed, so it overlaps compute -- the first
one before the diagonal block (step 0), forward and backward, so no step waits for a transfer posted after it.

Backward re-circulates k/v the same way; each rank computes the block gradients with the *merged* out and lse
(exact: P_block = exp(S_block - lse_total)). dq stays local; the dk/dv of a foreign block travel with an
accumulator that starts at the first rank that used them (j+1) and reaches the owner j after R-1 hops, where it
is added to the owner's own diagonal-block gradient. Bytes sent per rank and layer (K = bytes of one local k+v)::

    forward  (R-1) * K                  backward (R-1) * K  +  (R-1) * K_fp32   (dk/dv accumulated in fp32)

Bytes are recorded in ``topo.comm`` under the module's tag with ops ``p2p_fwd`` / ``p2p_bwd``.

Document masks and a sliding window: every block is cut into rectangles on the host (``ranges.py``, ``RingCuts``:
each ring rank's two zigzag chunks are its spans of global positions), run without a mask (``piecewise.py``, or
the variable-length kernel on CUDA) and merged into the same fp32 accumulators; a block without rectangles is
skipped (forward) or passes the travelling dk/dv accumulator on unchanged (backward). With a window smaller than a
chunk most off-diagonal blocks are skipped, so the work is O(s * W). The k/v still travel the whole ring (the
byte counts above do not change) -- unless the ranks hold the balanced layout (``parallel.cp_layout: balanced``,
``RingAttention(balanced=True)``): then its ``KvPlan`` (``kv_plan.py``) replaces ``RingCuts`` and each rank receives
only the rows its queries see, straight from their owner (``ring_exchange.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError
from ..config.documents import DocumentRanges
from ..parallel.collectives import count_send
from ..parallel.token_layout import ring_spans
from ..parallel.topology import Axis, Topology
from .backends import Kernels
from .core import CoreAttention, to_bnsd, to_sbnd
from .merge import merge
from .kv_plan import KvPlan, kv_plan
from .ranges import block_rects, rect_pairs, spans as laid_out
from .ring_exchange import exchange_backward, exchange_forward

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
        self.topo.comm.add_received(op, buf.numel() * buf.element_size())
        return _Pending(dist.batch_isend_irecv(ops), t, buf)

    def exchange(self, t: Optional[torch.Tensor], to: int, recv: Optional[torch.Tensor], frm: int, tag: int,
                 op: str) -> _Pending:
        """Post ``isend(t -> ring rank to)`` and ``irecv(recv <- ring rank frm)``, either None when nothing goes
        that way (both ends know it from the same plan); ``wait()`` returns ``recv``."""
        ranks, ops = self.topo.ranks(self.axis), []
        if t is not None:
            t = t.contiguous()
            ops.append(dist.P2POp(dist.isend, t, ranks[to], group=self.group, tag=tag))
            count_send(self.topo, t.numel() * t.element_size(), op)
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, recv, ranks[frm], group=self.group, tag=tag))
            self.topo.comm.add_received(op, recv.numel() * recv.element_size())
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], t, recv)


class RingCuts:
    """The rectangles of the block (queries of ring rank r, keys of ring rank j) under documents and a window, for
    ring ranks holding ``spans`` (``parallel/cp_balance.zigzag_spans``: rank j's zigzag chunks j and 2R-1-j).
    Example, s = 8, R = 2: rank 0 ``((0, 2, 0), (6, 8, 2))``, rank 1 ``((2, 4, 0), (4, 6, 2))``."""

    def __init__(self, documents: Optional[DocumentRanges], window: Optional[int], spans: tuple):
        self.documents, self.window = documents, window
        self.spans = [laid_out(list(sp)) for sp in spans]

    def rects(self, r: int, j: int):
        return block_rects(self.documents, self.window, self.spans[r], self.spans[j])


def _post_own_kv(k, v, comm: RingComm, op: str):
    """Step 0's transfer: this rank's k/v to the next rank, posted before the diagonal block so that it runs during
    it (None with a ring of one)."""
    return comm.send_recv(torch.stack([k, v]), KV_TAG, op) if comm.size > 1 else None


def ring_forward(q, k, v, comm: RingComm, backend, scale: Optional[float] = None, cuts=None):
    """Forward of ring attention on zigzag-local tensors ``[b, n, 2c, d]``; returns fp32 (out, lse). ``cuts``: the
    blocks' rectangles under documents / a window (None: causal over the whole sequence), or the balanced layout's
    ``KvPlan`` (``ring_exchange.py``: any local order)."""
    if isinstance(cuts, KvPlan):
        return exchange_forward(q, k, v, comm, backend, scale, cuts)
    if cuts is not None:
        return _ring_forward_rects(q, k, v, comm, backend, scale, cuts)
    R, r = comm.size, comm.rank
    c = q.shape[2] // 2
    n = q.shape[2]
    comm.topo.comm.add_pairs(q.shape[0] * (n * (n + 1) // 2 + (R - 1) * 2 * c * c))  # the diagonal, R-1 half blocks
    pending = _post_own_kv(k, v, comm, "p2p_fwd")  # in flight during the diagonal block
    out, lse = backend.forward(q, k, v, True, scale)  # step 0: own k/v, causal on the local order
    out, lse = out.float(), lse.float()
    if R == 1:
        return out, lse
    q_back = q[:, :, c:].contiguous()
    for i in range(1, R):
        kv = pending.wait()
        if i + 1 < R:
            pending = comm.send_recv(kv, KV_TAG, "p2p_fwd")  # next transfer in flight during this block
        j = (r - i) % R
        if j < r:  # all queries x front keys of j
            o, l = backend.forward(q, kv[0, :, :, :c].contiguous(), kv[1, :, :, :c].contiguous(), False, scale)
            out, lse = merge(out, lse, o, l)
        else:  # back queries x all keys of j
            o, l = backend.forward(q_back, kv[0], kv[1], False, scale)
            ob, lb = merge(out[:, :, c:], lse[:, :, c:], o, l)
            out, lse = torch.cat([out[:, :, :c], ob], dim=2), torch.cat([lse[:, :, :c], lb], dim=2)
            del ob, lb
        del o, l  # merged: not held through the next block's kernel
    return out, lse


def _ring_forward_rects(q, k, v, comm: RingComm, backend, scale, cuts: RingCuts):
    """``ring_forward`` over the blocks' rectangles, merged in place into one pair of fp32 accumulators."""
    R, r = comm.size, comm.rank
    pending = _post_own_kv(k, v, comm, "p2p_fwd")  # in flight during the diagonal block
    comm.topo.comm.add_pairs(sum(rect_pairs(cuts.rects(r, j), q.shape[0]) for j in range(R)))
    acc = backend.forward_rects(q, k, v, cuts.rects(r, r), scale)
    if R == 1:
        return acc
    for i in range(1, R):
        kv = pending.wait()
        if i + 1 < R:
            pending = comm.send_recv(kv, KV_TAG, "p2p_fwd")  # next transfer in flight during this block
        rects = cuts.rects(r, (r - i) % R)
        if rects:  # else: no query of this block shares a document (or a window) with its keys
            backend.forward_rects(q, kv[0], kv[1], rects, scale, acc=acc)
    return acc


def ring_backward(dout, q, k, v, out, lse, comm: RingComm, backend, scale: Optional[float] = None, cuts=None):
    """Backward of ``ring_forward`` given the merged ``out`` and ``lse``; returns dq, dk, dv in input dtypes."""
    if isinstance(cuts, KvPlan):
        return exchange_backward(dout, q, k, v, out, lse, comm, backend, scale, cuts)
    if cuts is not None:
        return _ring_backward_rects(dout, q, k, v, out, lse, comm, backend, scale, cuts)
    R, r = comm.size, comm.rank
    c = q.shape[2] // 2
    pending_kv = _post_own_kv(k, v, comm, "p2p_bwd")  # in flight during the diagonal block
    dq0, dk0, dv0 = backend.backward(dout, q, k, v, out, lse, True, scale)
    if R == 1:
        return dq0, dk0, dv0
    dq = dq0.float()
    own = torch.stack([dk0, dv0]).float()
    del dq0, dk0, dv0  # (under bf16 their fp32 copies above are what stays)
    back = (dout[:, :, c:].contiguous(), q[:, :, c:].contiguous(), out[:, :, c:].contiguous(),
            lse[:, :, c:].contiguous())
    pending_dkv = None
    for i in range(1, R):
        kv = pending_kv.wait()
        if i + 1 < R:
            pending_kv = comm.send_recv(kv, KV_TAG, "p2p_bwd")
        j = (r - i) % R
        if j < r:
            kf, vf = kv[0, :, :, :c].contiguous(), kv[1, :, :, :c].contiguous()
            dq_, dk_, dv_ = backend.backward(dout, q, kf, vf, out, lse, False, scale)
            del kf, vf
            dq += dq_.float()
            blk = F.pad(torch.stack([dk_, dv_]).float(), (0, 0, 0, c))  # zero grads for j's back chunk
            del dq_, dk_, dv_  # accumulated: not held through the next block's kernel
        else:
            dq_, dk_, dv_ = backend.backward(back[0], back[1], kv[0], kv[1], back[2], back[3], False, scale)
            dq[:, :, c:] += dq_.float()
            blk = torch.stack([dk_, dv_]).float()
            del dq_, dk_, dv_
        if pending_dkv is not None:
            blk = blk + pending_dkv.wait()  # accumulator of j's dk/dv from the ranks before this one
        pending_dkv = comm.send_recv(blk, DKV_TAG, "p2p_bwd")  # after step R-1 it reaches its owner
    own = own + pending_dkv.wait()
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


def _ring_backward_rects(dout, q, k, v, out, lse, comm: RingComm, backend, scale, cuts: RingCuts):
    """``ring_backward`` over the blocks' rectangles: dq and each block's dk/dv added into fp32 accumulators."""
    R, r = comm.size, comm.rank
    pending_kv = _post_own_kv(k, v, comm, "p2p_bwd")  # in flight during the diagonal block
    dq, dk0, dv0 = backend.backward_rects(dout, q, k, v, out, lse, cuts.rects(r, r), scale)
    if R == 1:
        return dq.to(q.dtype), dk0.to(k.dtype), dv0.to(v.dtype)
    own = torch.stack([dk0, dv0])
    del dk0, dv0
    pending_dkv = None
    for i in range(1, R):
        kv = pending_kv.wait()
        if i + 1 < R:
            pending_kv = comm.send_recv(kv, KV_TAG, "p2p_bwd")
        blk = torch.zeros_like(kv, dtype=torch.float32)  # j's dk/dv from this rank's queries (0 when skipped)
        rects = cuts.rects(r, (r - i) % R)
        if rects:
            backend.backward_rects(dout, q, kv[0], kv[1], out, lse, rects, scale, grads=(dq, blk[0], blk[1]))
        if pending_dkv is not None:
            blk = blk + pending_dkv.wait()  # accumulator of j's dk/dv from the ranks before this one
        pending_dkv = comm.send_recv(blk, DKV_TAG, "p2p_bwd")  # after step R-1 it reaches its owner
    own = own + pending_dkv.wait()
    return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype)


class RingAttnFunction(torch.autograd.Function):
    """q ``[b, nq, 2c, d]``, k/v ``[b, nkv, 2c, d]`` (zigzag-local order) -> out ``[b, nq, 2c, d]``."""

    @staticmethod
    def forward(ctx, q, k, v, comm: RingComm, backend, tag: str, scale: Optional[float], cuts):
        ctx.comm, ctx.backend, ctx.tag, ctx.scale, ctx.cuts = comm, backend, tag, scale, cuts
        with comm.topo.comm.tag(tag):
            out, lse = ring_forward(q, k, v, comm, backend, scale, cuts)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with ctx.comm.topo.comm.tag(ctx.tag):
            dq, dk, dv = ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.comm, ctx.backend, ctx.scale,
                                       ctx.cuts)
        return dq, dk, dv, None, None, None, None, None


class RingAttention(CoreAttention):
    """Core attention over the ring axis: q/k/v ``[s_local, b, n, d]`` (the layout's local order) ->
    ``[s_local, b, nq, d]``.

    With a ring of size 1 this is plain causal attention through the chosen kernel (used by Ulysses when
    cp_comm_type is a2a). ``window``: the layer's causal sliding window in tokens (None: every earlier token).
    ``balanced``: the ranks hold the balanced layout of ``balance_window`` (``parallel.cp_layout``,
    ``token_layout.ring_spans``) and exchange only the k/v their queries see; else the zigzag and the whole ring."""

    def __init__(self, topo: Topology, backend="auto", tag: str = "attn", axis: Axis = Axis.RING,
                 window: Optional[int] = None, balanced: bool = False, balance_window: Optional[int] = None):
        super().__init__()
        self.tag, self.window = tag, window
        self.balanced, self.balance_window = balanced, balance_window
        self.kernels = Kernels.of(backend)
        self.comm = RingComm(topo, axis)

    def _check_length(self, s: int) -> None:
        if self.comm.size > 1 and s % 2 != 0:
            raise ConfigError(f"ring attention: local sequence length ({s}) must be even (two zigzag chunks per "
                              f"rank, ring size {self.comm.size}); the full sequence must be divisible by "
                              f"{2 * self.comm.size} x ulysses size")

    def cuts(self, documents: Optional[DocumentRanges], s_local: int):
        """The blocks' rectangles for this ring (None: no documents, no window: the causal zigzag), or the
        balanced layout's exchange plan."""
        if documents is None and self.window is None:
            return None
        s, R = s_local * self.comm.size, self.comm.size
        spans = ring_spans(self.balanced, self.balance_window, documents, s, R)
        if self.balanced:
            return kv_plan(documents, self.window, spans, s)
        return RingCuts(documents, self.window, spans)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        self._check_length(q.shape[0])
        q_, k_, v_ = (t.permute(1, 2, 0, 3).contiguous() for t in (q, k, v))  # [b, n, s, d]
        out = RingAttnFunction.apply(q_, k_, v_, self.comm, self.kernels(q.device), self.tag, None,
                                     self.cuts(documents, q.shape[0]))
        return out.permute(2, 0, 1, 3)

    def forward_with_lse(self, q, k, v, documents=None):
        """The traffic of ``forward`` (same ops, same byte counters); lse ``[b, nq, s_local]`` fp32."""
        self._check_length(q.shape[0])
        with self.comm.topo.comm.tag(self.tag):
            out, lse = ring_forward(to_bnsd(q), to_bnsd(k), to_bnsd(v), self.comm, self.kernels(q.device),
                                    cuts=self.cuts(documents, q.shape[0]))
        return to_sbnd(out.to(q.dtype)), lse

    def backward_with_lse(self, dout, q, k, v, out, lse, documents=None):
        with self.comm.topo.comm.tag(self.tag):
            dq, dk, dv = ring_backward(to_bnsd(dout), to_bnsd(q), to_bnsd(k), to_bnsd(v), to_bnsd(out), lse,
                                       self.comm, self.kernels(q.device), cuts=self.cuts(documents, q.shape[0]))
        return to_sbnd(dq), to_sbnd(dk), to_sbnd(dv)
