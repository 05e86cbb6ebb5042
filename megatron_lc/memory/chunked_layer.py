"""A whole transformer layer run -- and run again for its backward -- with its token-wise parts in mini-sequences:
``memory.layer_chunk_size`` under ``activation_offload: checkpoints`` (``checkpoint_offload.py``). Token-wise
recompute / Memo chunk their dropped tokens in ``memo/steps.py``; this is the whole-layer re-run's counterpart.

A layer is ``pre`` (norm 1, QKV, RoPE) -> core attention -> ``post`` (out-proj, residual, norm 2, MLP); every op of
``pre`` and ``post`` is row-wise. With c tokens per mini-sequence and S local rows::

    forward (no graph)     q, k, v <- pre, chunk by chunk; out, lse <- core attention, whole;
                           y <- post, chunk by chunk
    backward (from x, dy)  q, k, v, out, lse again as in the forward, no graph
                           post re-run with autograd and backpropagated chunk by chunk -> dx (residual), dout
                           core attention backward, whole (``backward_with_lse``) -> dq, dk, dv
                           (here the checkpoints mode starts prefetching the next layer's input)
                           pre re-run with autograd and backpropagated chunk by chunk -> dx += (through norm 1)

so outside core attention the layer's working set is O(c) rows (the MLP's and QKV's intermediates of one chunk),
while x, dx, q, k, v, out, lse, dout and dq, dk, dv stay whole. With Megatron SP (tp = G > 1) ``pre`` all-gathers
over tp: a chunk's q holds G blocks of c rows, rows ``[g*S + a, g*S + b)`` of the whole (``TokenSplit``'s rule,
every token "dropped"). Example S = 6, c = 4, G = 2: chunk 1 is local rows 0-3 / gathered ``[00-03 10-13]``,
chunk 2 local rows 4-5 / gathered ``[04 05 14 15]``.

Exact: a chunk's rows are the rows of the whole (only the GEMM blocking of a smaller M may move the last bits).
"""
from __future__ import annotations

from typing import Optional

import torch

from .forward_state import as_in_forward, backward_from
from .token_split import TokenSplit


class ChunkedLayer:
    """One layer's forward / re-run + backward on ``S`` local rows in chunks of ``chunk`` tokens."""

    def __init__(self, layer, rope, documents, S: int, chunk: int, G: int, autocast: list):
        self.layer, self.rope, self.documents, self.autocast = layer, rope, documents, autocast
        self.core = layer.self_attention.core_attention
        self.split = TokenSplit(S, 0, G)  # every token "dropped": its rows selected per chunk
        self.chunks = self.split.dropped_chunks(chunk)

    def _rows(self, t: Optional[torch.Tensor], a: int, b: int):
        return None if t is None else self.split.dropped_rows(t, a, b)

    def _put(self, whole: torch.Tensor, a: int, b: int, part: torch.Tensor) -> None:
        """Write a chunk's gathered rows (G blocks of b - a) into the whole (G blocks of S)."""
        sp = self.split
        whole.view(sp.blocks, sp.tokens, *whole.shape[1:])[:, a:b] = part.view(sp.blocks, b - a, *whole.shape[1:])

    def _rope(self, a: int, b: int):
        return None if self.rope is None else tuple(self._rows(t, a, b) for t in self.rope)

    def attention(self, x: torch.Tensor) -> tuple:
        """q, k, v (pre, chunk by chunk) and the core attention's out, lse -- no graph."""
        qkv = None
        with as_in_forward(self.autocast, grad=False):
            for a, b in self.chunks:
                part = self.layer.pre_attention(x[a:b], self._rope(a, b))
                if qkv is None:
                    qkv = [p.new_empty(self.split.blocks * self.split.tokens, *p.shape[1:]) for p in part]
                for whole, p in zip(qkv, part):
                    self._put(whole, a, b, p)
            out, lse = self.core.forward_with_lse(*qkv, self.documents)
        return qkv, out, lse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, no graph."""
        _, out, _ = self.attention(x)
        y = torch.empty_like(x)  # the residual stream's dtype
        with as_in_forward(self.autocast, grad=False):
            for a, b in self.chunks:
                y[a:b] = self.layer.post_attention(x[a:b], self._rows(out, a, b))
        return y

    def backward(self, x: torch.Tensor, dy: torch.Tensor, after_attention=None) -> torch.Tensor:
        """Re-run from the input ``x`` and backpropagate ``dy``: parameter gradients accumulate; returns dx.
        ``after_attention()`` runs once q, k, v, out and dout are freed (the checkpoints mode prefetches the next
        layer's input there, so it is not alive at the attention backward, the re-run's peak)."""
        qkv, out, lse = self.attention(x)
        dx, dout = torch.empty_like(x), torch.empty_like(out)
        for a, b in self.chunks:
            xc = x[a:b].detach().requires_grad_()
            oc = self._rows(out, a, b).detach().requires_grad_()
            with as_in_forward(self.autocast, grad=True):
                yc = self.layer.post_attention(xc, oc)
            backward_from(yc, dy[a:b])
            del yc
            dx[a:b] = xc.grad
            self._put(dout, a, b, oc.grad)
        dqkv = self.core.backward_with_lse(dout, *qkv, out, lse, self.documents)
        del qkv, out, lse, dout
        if after_attention is not None:
            after_attention()
        for a, b in self.chunks:
            xc = x[a:b].detach().requires_grad_()
            with as_in_forward(self.autocast, grad=True):
                part = self.layer.pre_attention(xc, self._rope(a, b))
            pairs = [(p, self._rows(g, a, b)) for p, g in zip(part, dqkv) if g is not None]
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
            dx[a:b] += xc.grad
        return dx
