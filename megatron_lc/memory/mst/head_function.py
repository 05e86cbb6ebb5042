"""MsT LM head + cross entropy (MsT §3.1 Algorithm 2, Appendix B Algorithm 4): logits ``[n, V/tp]`` exist for one
chunk of n tokens at a time, in forward and in backward; no full logits tensor is ever made.

Vocab-parallel under tp: rank t holds rows ``[t*V/tp, (t+1)*V/tp)`` of the output weight; per chunk the softmax max
is all-reduced (MAX) and [target logit, sum of exp] all-reduced (SUM) over tp -- two small collectives per chunk
in forward, none in backward (the forward keeps the per-token log-sum-exp, 4 bytes a token).

Gradient computed in forward (default when autograd will need it). The loss is the last op of the graph, so the
chunk's ``d loss_t / d logits_t = softmax_t - onehot_t`` is known in forward except for the per-token factor g_t
that backward will bring. The forward therefore also computes, per chunk while the logits are in hand:
``u = (softmax - onehot) W`` (rows of dx before the factor g, ``[N, h]``) and ``D = sum_t (softmax_t - onehot_t)
x_t^T`` (``[V/tp, h]``, the weight-gradient sum). Backward then returns ``dx = g * u`` (exact for any g) and
``dW = c * D`` when g equals one constant c on every token with a label -- the training loop's case, loss =
sum(token loss * mask) / count with the all-ones mask -- and otherwise recomputes dW chunk by chunk from the saved
input and lse (exact for any g, e.g. a mask that zeroes or weights labelled tokens). This saves the backward
logits recompute of Algorithm 4 (a third of the head's matmuls); D turns into the weight's ``.grad``, which the
unchunked head allocates at the same point anyway, and u turns into dx in place. Both are ctx attributes, not
saved tensors, so saved-tensor hooks (offload) do not see them.

Without autograd (``torch.no_grad`` / eval) only the loss is computed.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ...device import has_values
from ...parallel.collectives import all_reduce
from ...parallel.topology import Axis, Topology
from .mlp_function import accumulate_mm, as_grad, cast_to, chunk_bounds, compute_dtype, grad_accumulator


def _target(labels: torch.Tensor, per: int, start: int, ignore_index: int):
    """Local column of each label in this vocab shard, and whether the label lives here (and is not ignored)."""
    local = labels - start
    in_shard = (local >= 0) & (local < per) & (labels != ignore_index)
    return local.clamp(0, per - 1).unsqueeze(-1), in_shard


def _grad_from_exp_(e: torch.Tensor, row_scale: torch.Tensor, onehot: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """In place: ``e * row_scale - onehot_at(idx)`` -- with e = exp(logits - m), row_scale = f / sum(exp) and
    onehot = f * [label in this shard], that is f * (softmax - onehot), f the per-token factor (0 if ignored).
    One pass over the chunk plus a scatter of n values."""
    e.mul_(row_scale.unsqueeze(-1))
    return e.scatter_add_(-1, idx, -onehot.to(e.dtype).unsqueeze(-1))


class _MiniSequenceLinearCE(torch.autograd.Function):
    """x ``[N, h]`` (identical on the tp ranks), weight ``[V/tp, h]``, labels: N global ids of any shape -> fp32
    per-token loss of the labels' shape (0 where the label is ``ignore_index``)."""

    @staticmethod
    def forward(ctx, x, weight, labels, topo: Topology, chunk: int, ignore_index: int, grad_in_forward: bool):
        dtype, per = compute_dtype(x), weight.shape[0]
        start, n = topo.tp_rank * per, x.shape[0]
        out = torch.empty(labels.shape, dtype=torch.float32, device=x.device)  # shaped like labels: not a view
        loss, labels = out.view(-1), labels.reshape(-1)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        want_u = grad_in_forward and ctx.needs_input_grad[0]
        want_dw = grad_in_forward and ctx.needs_input_grad[1]
        u = torch.empty(n, x.shape[1], dtype=dtype, device=x.device) if want_u else None
        dw = grad_accumulator(weight) if want_dw else None  # fp32 for a bf16 (FSDP2-gathered) weight
        with torch.autocast(x.device.type, enabled=False):
            xc_, wc = cast_to(x, dtype), cast_to(weight, dtype)
            for i0, i1 in chunk_bounds(n, chunk):
                lab = labels[i0:i1]
                valid = lab != ignore_index
                z = xc_[i0:i1].mm(wc.t()).float()  # the chunk's logits: the one [n, V/tp] buffer, reused in place
                vmax = torch.amax(z, dim=-1)  # (max(dim=-1) also computes indices: 3.5x slower on CPU)
                all_reduce(vmax, topo, Axis.TP, op=torch.distributed.ReduceOp.MAX)
                z.sub_(vmax.unsqueeze(-1))
                idx, in_shard = _target(lab, per, start, ignore_index)
                sums = torch.stack([torch.gather(z, -1, idx).squeeze(-1) * in_shard, z.exp_().sum(dim=-1)])
                all_reduce(sums, topo, Axis.TP)  # [target logit, sum of exp] over the vocab shards
                log_z = torch.log(sums[1])
                loss[i0:i1] = (log_z - sums[0]) * valid
                lse[i0:i1] = log_z + vmax
                if want_u or want_dw:
                    grad = cast_to(_grad_from_exp_(z, valid / sums[1], in_shard, idx), dtype)
                    if want_u:
                        torch.mm(grad, wc, out=u[i0:i1])
                    if want_dw:
                        accumulate_mm(dw, grad.t(), xc_[i0:i1])
                    del grad
                del z
        ctx.save_for_backward(xc_, weight, labels, lse)  # the input in the compute dtype (bf16 under autocast)
        ctx.u, ctx.dw = u, dw
        ctx.dtype, ctx.chunk, ctx.start, ctx.ignore_index, ctx.x_dtype = dtype, chunk, start, ignore_index, x.dtype
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight, labels, lse = ctx.saved_tensors
        valid = labels != ctx.ignore_index
        g = g.float().reshape(-1)
        # the precomputed dW holds when every valid token's gradient is the same (the loop's global mean without
        # masked tokens): dW = that gradient x the forward's sum. Fake tensors have no values: a rehearsal's mock
        # data masks no token, so its gradient is uniform and token 0's is it
        if has_values(g):
            gv = g[valid]
            uniform, scale = gv.numel() == 0 or bool((gv == gv[0]).all()), (gv[0] if gv.numel() else None)
        else:
            uniform, scale = True, g[0]
        dx = dw = None
        u, d, ctx.u, ctx.dw = ctx.u, ctx.dw, None, None  # consumed in place; a second backward recomputes
        if u is not None and ctx.needs_input_grad[0]:
            dx = u.mul_(g.to(u.dtype).unsqueeze(-1)).to(ctx.x_dtype)  # exact for any g
        if d is not None and ctx.needs_input_grad[1] and uniform:
            dw = as_grad(d.mul_(scale.to(d.dtype)) if scale is not None else d, weight)
        del u, d
        need_x = ctx.needs_input_grad[0] and dx is None
        need_w = ctx.needs_input_grad[1] and dw is None
        if need_x or need_w:
            dx_r, dw_r = _recompute_backward(ctx, x, weight, labels, lse, g * valid, need_x, need_w)
            dx = dx_r if need_x else dx
            dw = dw_r if need_w else dw
        return dx, dw, None, None, None, None, None


def _recompute_backward(ctx, x, weight, labels, lse, scale, need_x: bool, need_w: bool):
    """Algorithm 4: per chunk, recompute logits, turn them into ``g * (softmax - onehot)``, then dx and dW."""
    dtype, per = ctx.dtype, weight.shape[0]
    dx = torch.empty(x.shape, dtype=ctx.x_dtype, device=x.device) if need_x else None
    dw = grad_accumulator(weight) if need_w else None
    with torch.autocast(x.device.type, enabled=False):
        xc_, wc = cast_to(x, dtype), cast_to(weight, dtype)
        for i0, i1 in chunk_bounds(x.shape[0], ctx.chunk):
            xi = xc_[i0:i1]
            p = xi.mm(wc.t()).float().sub_(lse[i0:i1].unsqueeze(-1)).exp_()  # softmax from the saved lse
            idx, in_shard = _target(labels[i0:i1], per, ctx.start, ctx.ignore_index)
            f = scale[i0:i1]
            grad = cast_to(_grad_from_exp_(p, f, in_shard * f, idx), dtype)
            if dw is not None:
                accumulate_mm(dw, grad.t(), xi)
            if dx is not None:
                dx[i0:i1] = grad.mm(wc)
    return dx, as_grad(dw, weight)


def mini_sequence_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, topo: Topology,
                                chunk: int, ignore_index: int = -100,
                                grad_in_forward: bool | None = None) -> torch.Tensor:
    """Per-token loss (fp32, shaped like ``labels``) of the vocab-parallel head ``x [N, h] @ weight[V/tp, h]^T``
    against global ``labels`` of N tokens (any shape: the head returns ``[s, b]`` as it is, not a view of ``[N]``, so
    FSDP2's pre-backward hook sits on the tensor the loop uses), over chunks of ``chunk`` rows. ``grad_in_forward``
    (default: when autograd is recording and x or weight needs a gradient) precomputes the gradient in forward
    (module doc); ``False`` recomputes it in backward."""
    if grad_in_forward is None:
        grad_in_forward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    return _MiniSequenceLinearCE.apply(x, weight, labels, topo, chunk, ignore_index, grad_in_forward)
