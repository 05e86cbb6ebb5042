"""(out, lse) forms of the context-parallel core attention modules of ``attention/`` (ring, Ulysses, hybrid), for
token-wise recompute and Memo offload (see ``attention_io.py``).

Ring (``cp_comm_type: p2p``): ``ring_forward`` / ``ring_backward`` of ``attention/ring.py`` with the module's
ring, backend and byte-counter tag -- the same traffic as ``RingAttention``.

Ulysses (``a2a``, and ``a2a+p2p`` with a ring inside): forward = all-to-all q/k/v, inner (out, lse), all-to-all
out back; the kept tensors are the *local* out (``[s_l, b, nq, d]``) and the inner lse. Backward all-gathers q/k/v
and out again (the recomputation of two all-to-alls, no attention) besides dout, then the inner backward, then the
inverse all-to-all of dq/dk/dv. Extra backward traffic per layer compared with ``UlyssesAttention``'s autograd:
``(U-1)/U * s_l * b * d * e * (2 nq + 2 nkv')`` bytes (q, k, v and out), recorded under ``a2a_bwd``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention_io import _bnsd, _sbnd


class RingLse:
    def __init__(self, ring):
        self.ring = ring

    def forward(self, q, k, v):
        from ..attention.ring import ring_forward

        r = self.ring
        if r.comm.size > 1 and q.shape[0] % 2 != 0:
            r.forward(q, k, v)  # raises the module's own error about the local length
        with r.comm.topo.comm.tag(r.tag):
            out, lse = ring_forward(_bnsd(q), _bnsd(k), _bnsd(v), r.comm, r.backend(q.device))
        return _sbnd(out.to(q.dtype)), lse

    def backward(self, dout, q, k, v, out, lse):
        from ..attention.ring import ring_backward

        r = self.ring
        with r.comm.topo.comm.tag(r.tag):
            dq, dk, dv = ring_backward(_bnsd(dout), _bnsd(q), _bnsd(k), _bnsd(v), _bnsd(out), lse, r.comm,
                                       r.backend(q.device))
        return _sbnd(dq), _sbnd(dk), _sbnd(dv)


class UlyssesLse:
    def __init__(self, uly, inner):
        self.uly, self.inner = uly, inner

    def _gather_qkv(self, q, k, v, op: str):
        from ..attention.ulysses import gather_seq
        from ..parallel.topology import Axis

        u = self.uly
        s, b, nq, d = q.shape
        if u.rep > 1:
            k, v = k.repeat_interleave(u.rep, dim=2), v.repeat_interleave(u.rep, dim=2)
        nkv = k.shape[2]
        packed = torch.cat([t.reshape(s, b, u.U, t.shape[2] // u.U, d) for t in (q, k, v)], dim=3)
        full = gather_seq(packed, u.topo, Axis.ULYSSES, op)
        return torch.split(full, [nq // u.U, nkv // u.U, nkv // u.U], dim=2)

    def _gather_heads(self, t, op: str):
        from ..attention.ulysses import gather_seq
        from ..parallel.topology import Axis

        s, b, n, d = t.shape
        return gather_seq(t.reshape(s, b, self.uly.U, n // self.uly.U, d), self.uly.topo, Axis.ULYSSES, op)

    def _scatter(self, t, op: str):
        from ..attention.ulysses import scatter_seq
        from ..parallel.topology import Axis

        return scatter_seq(t.contiguous(), self.uly.topo, Axis.ULYSSES, op)  # [s, b, U, m, d]

    def forward(self, q, k, v):
        u = self.uly
        with u.topo.comm.tag(u.tag):
            ql, kl, vl = (t.contiguous() for t in self._gather_qkv(q, k, v, "a2a_fwd"))
            out_l, lse = self.inner.forward(ql, kl, vl)
            s, b, nq, d = q.shape
            out = self._scatter(out_l, "a2a_fwd").reshape(s, b, nq, d)
        return out, lse

    def backward(self, dout, q, k, v, out, lse):
        u = self.uly
        s, b, nq, d = q.shape
        nkv = k.shape[2]
        with u.topo.comm.tag(u.tag):
            ql, kl, vl = (t.contiguous() for t in self._gather_qkv(q, k, v, "a2a_bwd"))
            out_l = self._gather_heads(out, "a2a_bwd")
            dout_l = self._gather_heads(dout.contiguous(), "a2a_bwd")
            dql, dkl, dvl = self.inner.backward(dout_l, ql, kl, vl, out_l, lse)
            back = self._scatter(torch.cat([dql, dkl, dvl], dim=2), "a2a_bwd")  # [s, b, U, m, d]
        nkv_rep = nkv * u.rep
        dq, dk, dv = torch.split(back, [nq // u.U, nkv_rep // u.U, nkv_rep // u.U], dim=3)
        dq = dq.reshape(s, b, nq, d)
        dk, dv = dk.reshape(s, b, nkv_rep, d), dv.reshape(s, b, nkv_rep, d)
        if u.rep > 1:  # replicas of a kv head: sum their gradients back (inverse of repeat_interleave)
            dk, dv = (t.view(s, b, nkv, u.rep, d).sum(3) for t in (dk, dv))
        return dq, dk, dv


def adapt(core, backend_name: str) -> Optional[object]:
    """The (out, lse) form of ``core`` when it is one of the context-parallel modules, else None."""
    from ..attention.ring import RingAttention
    from ..attention.ulysses import UlyssesAttention
    from .attention_io import lse_attention

    if isinstance(core, RingAttention):
        return RingLse(core)
    if isinstance(core, UlyssesAttention):
        return UlyssesLse(core, lse_attention(core.inner, backend_name))
    return None
