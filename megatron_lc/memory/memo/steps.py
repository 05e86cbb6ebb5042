"""Token-wise recompute that never re-runs attention, and Memo's token split (the Memo paper's section 4.1; LightSeq's
rematerialization-aware checkpointing): the token split and the autograd functions ``executor.py`` runs a layer with.

A layer is ``pre`` (norm, QKV, RoPE: token-wise) -> core attention (mixes tokens) -> ``post`` (out-proj, residual,
norm, MLP: token-wise). Its S local tokens are split: the first ``sA = floor(alpha * S)`` are *kept* -- ``pre`` and
``post`` run on them with autograd and every tensor they save goes to the layer's ``SkeletalSlot`` (offloaded by
Memo) -- and the other ``sD = S - sA`` are *dropped*: ``pre``/``post`` run on them without autograd and are run
again, on those tokens only, just before their backward. The layer input and the attention output + lse are always
kept whole, so attention runs once per step and the recompute is exact (only token-wise ops are repeated).

    alpha = 0   (``recompute_granularity: full``; Memo with no offload of "others"): every token recomputed
    alpha = 1   nothing recomputed; Memo offloads every skeletal tensor

With Megatron sequence parallelism (tp = G > 1) ``pre`` all-gathers over tp, so its outputs hold G blocks of S
tokens; ``token_split.TokenSplit`` cuts and merges local and gathered tensors.

``memory.layer_chunk_size`` = c: the dropped tokens' ``post`` (forward and recompute) and ``pre`` (recompute) run in
mini-sequences of c tokens, so outside core attention a layer's working set is O(c) rows, not O(S) (the attention
backward still holds the dropped tokens' q, k, v, computed once more without a graph). With c = 2 above, chunk 1 is
local ``[r1 r2]`` / gathered ``[01 02 11 12]`` and chunk 2 local ``[r3]`` / gathered ``[03 13]``.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...device import storage_id
from ..forward_state import as_in_forward, autocast_state, backward_from
from ..token_split import TokenSplit
from .runtime import MemoRuntime
from .slots import SkeletalSlot


class LayerStep:
    """Everything one layer's forward leaves for its backward (held by the autograd Functions' ctx)."""

    def __init__(self, runtime: MemoRuntime, layer, core, slot: SkeletalSlot, split: TokenSplit, rope_d, pre_fn,
                 post_fn, documents=None):
        # core: the layer's core attention (``attention/core.py`` protocol); None in block mode
        self.runtime, self.layer, self.core, self.slot, self.split = runtime, layer, core, slot, split
        self.rope_d = rope_d
        self.documents = documents  # config.DocumentRanges of packed documents, or None
        self.pre_fn, self.post_fn = pre_fn, post_fn  # token-wise parts: (x, rope) -> tuple, (x, attn) -> y
        self.autocast = autocast_state()  # bf16 on GPU, re-entered for the recompute
        self.h_input = self.h_attn = self.h_lse = None
        self.h_qkv_kept: Optional[list] = None
        self.pre_d = None  # (leaf x, (q, k, v)) of the recomputed dropped tokens

    def kept_input(self) -> torch.Tensor:
        return self.slot.unpack(self.h_input)

    def kept_attn(self) -> torch.Tensor:
        return self.slot.unpack(self.h_attn)

    def rerun(self, fn, *args, outputs_kept: bool = False) -> tuple:
        """``fn(*args)`` run again with autograd; the bytes it saves (the recomputed skeletal tensors, by storage;
        its outputs too with ``outputs_kept``) are added to the slot's stats and acquired under ``memo.recompute``
        -- the caller releases them after the backward. Returns (outputs, bytes)."""
        refs = set(self.slot.refs) | {storage_id(self.kept_input()),
                                      storage_id(self.kept_attn())}
        probe = SkeletalSlot(self.slot.layer, "measure", refs)
        with as_in_forward(self.autocast, grad=True) as stack:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(probe.pack, probe.unpack))
            out = fn(*args)
        if outputs_kept:
            for t in out:
                probe.keep("other", t.detach())
        probe.flush()
        nbytes = probe.stats.bytes["other"]
        self.slot.stats.bytes_recomputed += nbytes
        self.runtime.account.acquire("memo.recompute", nbytes)
        return out, nbytes

    def backward_done(self) -> None:
        """The layer's backward is over: drop its kept tensors now (this step sits on autograd's ctx, which lives
        until the whole graph goes, so without this every layer's input and attention output stayed alive until
        the end of the step's backward) and tell the runtime."""
        self.h_input = self.h_attn = self.h_lse = self.h_qkv_kept = self.pre_d = None
        self.runtime.layer_backward_done(self.slot)

    @property
    def chunk(self) -> Optional[int]:
        """Tokens per mini-sequence of the dropped tokens' recompute (None: all at once)."""
        c = self.runtime.chunk_tokens
        return c if c is not None and c < self.split.dropped else None

    def dropped_qkv(self):
        """q, k, v of the dropped tokens for the attention backward: with mini-sequences, recomputed whole without a
        graph (the pre backward recomputes them chunk by chunk); else the graph of ``recompute_pre``."""
        if self.chunk is None:
            return tuple(t.detach() for t in self.recompute_pre()[1])
        with as_in_forward(self.autocast, grad=False):
            return tuple(self.pre_fn(self.split.local(self.kept_input())[1], self.rope_d))

    def recompute_pre(self):
        """The pre-attention outputs (q, k, v) of the dropped tokens, with their autograd graph (once)."""
        if self.pre_d is None:
            x = self.split.local(self.kept_input())[1].detach().requires_grad_()
            # the attention backward needs q, k, v: counted like the kept ones
            qkv, nbytes = self.rerun(lambda *a: tuple(self.pre_fn(*a)), x, self.rope_d,
                                     outputs_kept=self.core is not None)
            self.pre_d = (x, qkv, nbytes)
        return self.pre_d


class PreDropped(torch.autograd.Function):
    """q, k, v (or the norm output, block mode) of the dropped tokens: no graph; recomputed before their backward."""

    @staticmethod
    def forward(ctx, st: LayerStep, x_d, always_grad):
        ctx.st = st
        return tuple(st.pre_fn(x_d, st.rope_d))

    @staticmethod
    def backward(ctx, *grads):
        st = ctx.st
        if st.chunk is not None:
            dx = _pre_backward_chunks(st, grads)
        else:
            x, qkv, nbytes = st.recompute_pre()
            pairs = [(t, g) for t, g in zip(qkv, grads) if g is not None]
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            st.pre_d = None
            st.runtime.account.release("memo.recompute", nbytes)
            dx = x.grad
        st.backward_done()
        return None, dx, None


def _pre_backward_chunks(st: LayerStep, grads) -> torch.Tensor:
    """``pre`` of the dropped tokens re-run and backpropagated one mini-sequence at a time; returns their dx."""
    sp = st.split
    x_all = sp.local(st.kept_input())[1]
    dx = torch.empty_like(x_all)
    for a, b in sp.dropped_chunks(st.chunk):
        x = x_all[a:b].detach().requires_grad_()
        rope = None if st.rope_d is None else tuple(sp.dropped_rows(t, a, b) for t in st.rope_d)
        qkv, nbytes = st.rerun(lambda *args: tuple(st.pre_fn(*args)), x, rope)
        pairs = [(t, sp.dropped_rows(g, a, b)) for t, g in zip(qkv, grads) if g is not None]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        st.runtime.account.release("memo.recompute", nbytes)
        dx[a:b] = x.grad
    return dx


class PostDropped(torch.autograd.Function):
    """Out-proj + residual + MLP of the dropped tokens: no graph in forward, recomputed in backward."""

    @staticmethod
    def forward(ctx, st: LayerStep, x_d, o_d, always_grad):
        ctx.st = st
        if st.chunk is None:
            return st.post_fn(x_d, o_d)
        y = torch.empty_like(x_d)  # the layer output keeps the residual stream's dtype
        for a, b in st.split.dropped_chunks(st.chunk):
            y[a:b] = st.post_fn(x_d[a:b], st.split.dropped_rows(o_d, a, b))
        return y

    @staticmethod
    def backward(ctx, dy):
        st = ctx.st
        sp = st.split
        x_all = sp.local(st.kept_input())[1]
        o_all = st.kept_attn()[sp.blocks * sp.kept:]  # dropped rows come last
        dx, do = torch.empty_like(x_all), torch.empty_like(o_all)
        for a, b in sp.dropped_chunks(st.chunk):
            x = x_all[a:b].detach().requires_grad_()
            o = sp.dropped_rows(o_all, a, b).detach().requires_grad_()
            y, nbytes = st.rerun(st.post_fn, x, o)
            backward_from(y, dy[a:b])
            del y
            st.runtime.account.release("memo.recompute", nbytes)
            dx[a:b] = x.grad
            if sp.blocks == 1:
                do[a:b] = o.grad
            else:
                do.view(sp.blocks, sp.dropped, *do.shape[1:])[:, a:b] = o.grad.view(sp.blocks, b - a, *do.shape[1:])
        return None, dx, do, None


class SplitAttention(torch.autograd.Function):
    """Core attention once; keeps out (in kept-then-dropped token order) and lse, and the kept tokens' q, k, v."""

    @staticmethod
    def forward(ctx, st: LayerStep, qa, ka, va, qd, kd, vd):
        sp = st.split
        q, k, v = sp.merge(qa, qd), sp.merge(ka, kd), sp.merge(va, vd)
        out, lse = st.core.forward_with_lse(q, k, v, st.documents)
        st.runtime.attn_forward_calls += 1
        if sp.blocks > 1 and sp.kept and sp.dropped:
            out = torch.cat(sp.gathered(out))  # kept rows first, so both parts are views of one tensor
        st.h_attn = st.slot.keep("attn", out)
        st.h_lse = st.slot.keep("lse", lse)
        if sp.kept:
            st.h_qkv_kept = [st.slot.keep("other", t) for t in (qa, ka, va)]
        ctx.st = st
        return out

    @staticmethod
    def backward(ctx, dout):
        st = ctx.st
        sp, slot = st.split, st.slot
        out, lse = st.kept_attn(), slot.unpack(st.h_lse)
        qa = ka = va = qd = kd = vd = None
        if sp.kept:
            qa, ka, va = (slot.unpack(h) for h in st.h_qkv_kept)
        if sp.dropped:
            qd, kd, vd = st.dropped_qkv()
        q, k, v = sp.merge(qa, qd), sp.merge(ka, kd), sp.merge(va, vd)
        if sp.blocks > 1 and sp.kept and sp.dropped:
            n = sp.blocks * sp.kept
            out, dout = sp.merge(out[:n], out[n:]), sp.merge(dout[:n], dout[n:])
        dq, dk, dv = st.core.backward_with_lse(dout, q, k, v, out, lse, st.documents)
        grads = []
        for g in (dq, dk, dv):
            grads.append(sp.gathered(g) if (sp.kept and sp.dropped) else ((g, None) if sp.kept else (None, g)))
        if not sp.dropped:
            st.backward_done()
        return (None, grads[0][0], grads[1][0], grads[2][0], grads[0][1], grads[1][1], grads[2][1])
