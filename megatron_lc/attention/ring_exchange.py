"""Ring attention over the balanced layout: each rank receives only the k/v rows its queries see, straight from
their owner, and returns only their dk/dv (``kv_plan.py`` plans the rows; ``ring.py`` is the zigzag ring).

Steps ``i = 1 .. R-1``, as the ring's, but each a pair of direct transfers: ring rank ``r`` receives from
``j = r - i`` the rows ``plan.rows[r][j]`` of j's k/v and sends ``plan.rows[r + i][r]`` of its own to ``r + i``
(mod R); a direction with no rows posts nothing, and a rank whose documents are all local posts nothing at all.
Example, R = 4, step 2: 0 <- 2 and 0 -> 2, 1 <- 3 and 1 -> 3 (the ring's step 2 pairs, without the hops between).
The next step's transfer is posted before the current block runs, so it overlaps compute as the ring's does (the
first before the diagonal block); at most two received buffers are alive.

Backward: the same k/v rows arrive again; the fp32 dk/dv of step i's rows go back to their owner ``r - i`` while
step ``i + 1`` runs, and the grads of the rows this rank sent to ``r + i`` come back and are added at their local
rows (``index_add_`` along the sequence of the contiguous fp32 accumulators). Bytes are counted as the ring's, under
``p2p_fwd`` / ``p2p_bwd`` (sent) and in ``CommStats.received``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .kv_plan import KvPlan
from .ranges import rect_pairs

KV_TAG, DKV_TAG = 13, 14  # distinct from the zigzag ring's tags


def _index(rows: tuple, device) -> torch.Tensor:
    """Local row ranges -> one index along the sequence."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in rows])


class _Steps:
    """The plan's transfers of one rank, step by step."""

    def __init__(self, plan: KvPlan, comm, k: torch.Tensor):
        self.plan, self.comm, self.R, self.r = plan, comm, comm.size, comm.rank
        self.k = k
        self.sent = {}  # step -> the local index of the rows sent at that step (for their returning grads)

    def peers(self, i: int) -> tuple[int, int]:
        """(the rank sending to this one, the rank this one sends to) at step ``i``."""
        return (self.r - i) % self.R, (self.r + i) % self.R

    def post_kv(self, i: int, k, v, op: str):
        """Step ``i``'s k/v: own rows to ``r + i``, rows of ``r - i`` into a fresh buffer ``[2, b, n, m, d]``."""
        frm, to = self.peers(i)
        send = recv = None
        if self.plan.rows[to][self.r]:
            idx = self.sent[i] = _index(self.plan.rows[to][self.r], k.device)
            send = torch.stack([k.index_select(2, idx), v.index_select(2, idx)])
        m = self.plan.count(self.r, frm)
        if m:
            b, n, _, d = k.shape
            recv = torch.empty((2, b, n, m, d), dtype=k.dtype, device=k.device)
        return self.comm.exchange(send, to, recv, frm, KV_TAG, op)

    def post_dkv(self, i: int, grads: Optional[torch.Tensor]):
        """Step ``i``'s returns: the fp32 grads of the rows received from ``r - i`` back to it, those of the rows
        sent to ``r + i`` from it."""
        frm, to = self.peers(i)
        recv = None
        if i in self.sent:
            b, n, _, d = self.k.shape
            recv = torch.empty((2, b, n, self.sent[i].numel(), d), dtype=torch.float32, device=self.k.device)
        return self.comm.exchange(grads, frm, recv, to, DKV_TAG, "p2p_bwd")


def exchange_forward(q, k, v, comm, backend, scale, plan: KvPlan):
    """fp32 (out, lse) of this rank's queries ``[b, nq, s_l, d]`` over every key they see."""
    steps = _Steps(plan, comm, k)
    R, r = steps.R, steps.r
    pending = steps.post_kv(1, k, v, "p2p_fwd") if R > 1 else None  # in flight during the diagonal block
    comm.topo.comm.add_pairs(rect_pairs(plan.own_rects(r), q.shape[0])
                             + sum(rect_pairs(plan.recv_rects(r, j), q.shape[0]) for j in range(R) if j != r))
    acc = backend.forward_rects(q, k, v, plan.own_rects(r), scale)
    for i in range(1, R):
        kv = pending.wait()
        if i + 1 < R:
            pending = steps.post_kv(i + 1, k, v, "p2p_fwd")  # next transfer in flight during this block
        if kv is not None:
            backend.forward_rects(q, kv[0], kv[1], plan.recv_rects(r, steps.peers(i)[0]), scale, acc=acc)
        del kv
    return acc


def exchange_backward(dout, q, k, v, out, lse, comm, backend, scale, plan: KvPlan):
    """dq, dk, dv (input dtypes) of ``exchange_forward`` from the merged ``out`` and ``lse``."""
    steps = _Steps(plan, comm, k)
    R, r = steps.R, steps.r
    pending_kv = steps.post_kv(1, k, v, "p2p_bwd") if R > 1 else None
    dq, dk, dv = backend.backward_rects(dout, q, k, v, out, lse, plan.own_rects(r), scale)
    returning = None  # (step, pending grads of the rows sent at that step)
    for i in range(1, R):
        kv = pending_kv.wait()
        if i + 1 < R:
            pending_kv = steps.post_kv(i + 1, k, v, "p2p_bwd")
        grads = None
        if kv is not None:
            grads = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            backend.backward_rects(dout, q, kv[0], kv[1], out, lse, plan.recv_rects(r, steps.peers(i)[0]), scale,
                                   grads=(dq, grads[0], grads[1]))
        del kv
        if returning is not None:
            _add_returned(dk, dv, steps, *returning)
        returning = (i, steps.post_dkv(i, grads))  # waited for after the next block
        del grads
    if returning is not None:
        _add_returned(dk, dv, steps, *returning)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _add_returned(dk, dv, steps: _Steps, i: int, pending) -> None:
    g = pending.wait()
    if g is not None:
        dk.index_add_(2, steps.sent[i], g[0])
        dv.index_add_(2, steps.sent[i], g[1])


__all__ = ["exchange_backward", "exchange_forward"]
