"""A whole transformer layer run -- and run again for its backward -- with its token-wise parts in mini-sequences:
``memory.layer_chunk_size`` under ``activation_offload: checkpoints`` (``checkpoint_offload.py``). Token-wise
recompute / Memo chunk their dropped tokens in ``memo/steps.py``; this is the whole-layer re-run's counterpart.

A layer is an attention part -> ``post`` (out-proj, residual, norm 2, MLP), every op of ``post`` row-wise. Two
attention parts, by the layer's attention block (``compose/context.py`` hands the runtime one, keyed by
``config.Techniques.layer_rerun``):

* ``CoreAttentionPart`` (``SelfAttention``, ``layer_mini_sequences``): ``pre`` (norm 1, QKV, RoPE) chunk by chunk
  into whole q, k, v; the core attention whole through its (out, lse) pair; in backward ``backward_with_lse`` ->
  dq, dk, dv, then ``pre`` re-run with autograd and backpropagated chunk by chunk.
* ``BlockAttentionPart`` (FPDT's block, ``block_mini_sequences``): the block with norm 1 inside each of its chunk
  projections (``FPDTSelfAttention.attend``) reads the layer input and chunks, all-to-alls and attends its own u
  chunks -- parked on the host with ``memory.fpdt_offload`` --, so no whole q, k, v exists; in backward autograd
  through the block (FPDT's pipelined backward, its projections' per chunk).

With c tokens per mini-sequence and S local rows::

    forward (no graph)     out <- the attention part; y <- post, chunk by chunk
    backward (from x, dy)  out again, with what the part's backward needs (core: q, k, v, out, lse whole; FPDT:
                           the chunks parked by the block)
                           post re-run with autograd and backpropagated chunk by chunk -> dx (residual), dout
                           the part's backward -> dx += (through norm 1)
                           (the checkpoints mode starts prefetching the next input after the attention backward)

so outside the attention the layer's working set is O(c) rows, while x, dx, dy, out and dout stay whole (and with
a core attention q, k, v, lse and dq, dk, dv). Rows: the attention output holds u groups (FPDT's chunks; 1 for a
core attention) of S/u local rows each, every group G blocks of them with Megatron SP (tp = G > 1: gathered
rows, ``TokenSplit``'s rule, every token "dropped"); a mini-sequence never crosses a group. Example S = 6, c = 4,
G = 2, u = 1: chunk 1 is local rows 0-3 / gathered ``[00-03 10-13]``, chunk 2 local rows 4-5 / gathered
``[04 05 14 15]``; FPDT with u = 2 and c = 4: chunks are local rows 0-2 (group 0) and 3-5 (group 1).

Exact: a chunk's rows are the rows of the whole (only the GEMM blocking of a smaller M may move the last bits).
"""
from __future__ import annotations

from typing import Optional

import torch

from .forward_state import as_in_forward, backward_from
from .token_split import TokenSplit


class Rows:
    """The layer's S local rows in mini-sequences of at most ``chunk`` and, for each, its rows of the attention
    output: ``groups`` groups of S / groups local rows, each ``G`` blocks of them (see module doc)."""

    def __init__(self, S: int, G: int, groups: int, chunk: Optional[int]):
        self.P, self.G = S // groups, G
        self.split = TokenSplit(self.P, 0, G)  # one group's rows, every token "dropped": selected per chunk
        self.chunks = [(i * self.P + a, i * self.P + b) for i in range(groups)
                       for a, b in self.split.dropped_chunks(chunk)]

    def _group(self, t: torch.Tensor, a: int):
        i, n = a // self.P, self.G * self.P
        return t[i * n:(i + 1) * n], a - i * self.P

    def of(self, t: Optional[torch.Tensor], a: int, b: int):
        """The gathered rows of ``t`` (attention rows) that go with local rows ``[a, b)``."""
        if t is None:
            return None
        g, a0 = self._group(t, a)
        return self.split.dropped_rows(g, a0, a0 + b - a)

    def put(self, whole: torch.Tensor, a: int, b: int, part: torch.Tensor) -> None:
        """Write a chunk's gathered rows (G blocks of b - a) into the whole."""
        g, a0 = self._group(whole, a)
        g.view(self.G, self.P, *whole.shape[1:])[:, a0:a0 + b - a] = part.view(self.G, b - a, *whole.shape[1:])


class CoreAttentionPart:
    """``pre`` chunk by chunk + the core attention whole, through its protocol (``attention/core.py``)."""

    groups = 1

    def __init__(self, layer, rope, documents, autocast: list):
        self.layer, self.rope, self.documents, self.autocast = layer, rope, documents, autocast
        self.core = layer.self_attention.core_attention
        self.saved = None

    def _rope(self, rows: Rows, a: int, b: int):
        return None if self.rope is None else tuple(rows.of(t, a, b) for t in self.rope)

    def _attention(self, x: torch.Tensor, rows: Rows) -> tuple:
        qkv = None
        with as_in_forward(self.autocast, grad=False):
            for a, b in rows.chunks:
                part = self.layer.pre_attention(x[a:b], self._rope(rows, a, b))
                if qkv is None:
                    qkv = [p.new_empty(rows.G * x.shape[0], *p.shape[1:]) for p in part]
                for whole, p in zip(qkv, part):
                    rows.put(whole, a, b, p)
            out, lse = self.core.forward_with_lse(*qkv, self.documents)
        return qkv, out, lse

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The attention output, no graph."""
        return self._attention(x, rows)[1]

    def rerun(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The attention output again, keeping q, k, v, out and lse for ``backward``."""
        qkv, out, lse = self._attention(x, rows)
        self.saved = (qkv, out, lse)
        return out

    def backward(self, x: torch.Tensor, douts: list, dx: torch.Tensor, rows: Rows, after_attention) -> None:
        """dq, dk, dv from ``douts``' one tensor (handed over in a list: freed here), then ``pre`` backward into
        ``dx``."""
        qkv, out, lse = self.saved
        self.saved, dout = None, douts.pop()
        dqkv = self.core.backward_with_lse(dout, *qkv, out, lse, self.documents)
        del qkv, out, lse, dout
        if after_attention is not None:
            after_attention()
        for a, b in rows.chunks:
            xc = x[a:b].detach().requires_grad_()
            with as_in_forward(self.autocast, grad=True):
                part = self.layer.pre_attention(xc, self._rope(rows, a, b))
            pairs = [(p, rows.of(g, a, b)) for p, g in zip(part, dqkv) if g is not None]
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
            dx[a:b] += xc.grad


class BlockAttentionPart:
    """FPDT's block with norm 1 inside its chunk projections (``FPDTSelfAttention.attend``): its output rows are
    chunk-major, so one row group per FPDT chunk."""

    def __init__(self, layer, rope, documents, autocast: list):
        self.layer, self.rope, self.documents, self.autocast = layer, rope, documents, autocast
        self.block = layer.self_attention
        self.groups = self.block.num_chunks
        self.saved = None

    def forward(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        with as_in_forward(self.autocast, grad=False):
            return self.block.attend(x, self.rope, self.documents, self.layer.input_layernorm)

    def rerun(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The block's output with its graph (the block parks its chunks); the input's grad collects in a leaf."""
        leaf = x.detach().requires_grad_()
        with as_in_forward(self.autocast, grad=True):
            out = self.block.attend(leaf, self.rope, self.documents, self.layer.input_layernorm)
        self.saved = (leaf, out)
        return out

    def backward(self, x: torch.Tensor, douts: list, dx: torch.Tensor, rows: Rows, after_attention) -> None:
        leaf, out = self.saved
        self.saved, dout = None, douts.pop()
        # the block's backward reads its parked chunks, never its output: the output is only the graph's root
        out.untyped_storage().resize_(0)
        torch.autograd.backward(out, dout)
        del out, dout
        if after_attention is not None:
            after_attention()
        dx += leaf.grad


class ChunkedLayer:
    """One layer's forward / re-run + backward on ``S`` local rows in chunks of ``chunk`` tokens, around its
    attention part (``CoreAttentionPart`` or ``BlockAttentionPart``)."""

    def __init__(self, layer, rope, documents, S: int, chunk: Optional[int], G: int, autocast: list, part):
        self.layer, self.autocast = layer, autocast
        self.attn = part(layer, rope, documents, autocast)
        self.rows = Rows(S, G, self.attn.groups, chunk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output, no graph."""
        out = self.attn.forward(x, self.rows)
        y = torch.empty_like(x)  # the residual stream's dtype
        with as_in_forward(self.autocast, grad=False):
            for a, b in self.rows.chunks:
                y[a:b] = self.layer.post_attention(x[a:b], self.rows.of(out, a, b))
        return y

    def backward(self, x: torch.Tensor, dy: torch.Tensor, after_attention=None) -> torch.Tensor:
        """Re-run from the input ``x`` and backpropagate ``dy``: parameter gradients accumulate; returns dx.
        ``after_attention()`` runs once the attention's backward is done and q, k, v, out and dout are freed (the
        checkpoints mode prefetches the next layer's input there, so it is not alive at the attention backward, the
        re-run's peak)."""
        out = self.attn.rerun(x, self.rows)
        dx, dout = torch.empty_like(x), torch.empty_like(out)
        for a, b in self.rows.chunks:
            xc = x[a:b].detach().requires_grad_()
            oc = self.rows.of(out, a, b).detach().requires_grad_()
            with as_in_forward(self.autocast, grad=True):
                yc = self.layer.post_attention(xc, oc)
            backward_from(yc, dy[a:b])
            del yc
            dx[a:b] = xc.grad
            self.rows.put(dout, a, b, oc.grad)
        douts = [dout]  # the part frees it after its backward: no other reference may stay here
        del out, dout
        self.attn.backward(x, douts, dx, self.rows, after_attention)
        return dx
