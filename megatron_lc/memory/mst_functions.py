"""The two MsT autograd functions: mini-sequence MLP and mini-sequence LM head + cross entropy.

Both work on token rows ``[N, h]`` (the ``[s, b]`` token grid flattened, s-major) and cut them into chunks of
``chunk`` rows; the last chunk holds the remainder (N = 4100, chunk = 1024 -> 1024, 1024, 1024, 1024, 4), so no
token is ever dropped. The big intermediates -- ``[n, ffn]`` for the MLP, ``[n, V/tp]`` logits for the head -- exist
for one chunk at a time, in forward and in backward (where they are recomputed chunk by chunk, MsT Appendix B,
Algorithms 3-4). Weight gradients are summed over the chunks inside ``backward`` and *returned* to autograd, which
accumulates them into ``.grad`` like any other gradient (MsT's reference code writes ``weight.grad`` by hand, which
breaks gradient accumulation hooks and double-counts under re-entrant use).

Communication stays outside: the tp/SP input mapping (all-gather or copy) and output mapping (reduce-scatter or
all-reduce) are applied by the modules in ``mst.py`` on whole tensors, so these functions return *partial* input
gradients under tp, exactly like ``F.linear`` in the unchunked column/row linears. The only collectives here are the
head's per-chunk vocab reductions in forward (max, then sum of [target logit, sum of exp]); backward needs none since
the forward keeps the per-token log-sum-exp.

Mixed precision: under autocast the matmuls run in the autocast dtype, weight gradients are accumulated in the
weight's dtype (fp32 master weights). That branch is never executed here (CPU, fp32).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..parallel.collectives import all_reduce
from ..parallel.topology import Axis, Topology


def chunk_bounds(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[(0, c), (c, 2c), ..., (k*c, n)]``: every row in exactly one chunk, the last one possibly shorter."""
    chunk = max(1, int(chunk))
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def _cast(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in acc's dtype (fp32 master grads even when a, b are bf16)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:  # GPU mixed precision only
        acc.add_(a.mm(b))


# ---- MLP ---------------------------------------------------------------------------------------------------------
def _activation(h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h, approximate="tanh")


def _activation_backward(da: torch.Tensor, h: torch.Tensor, swiglu: bool) -> torch.Tensor:
    """d(loss)/dh from d(loss)/d(activation(h))."""
    if swiglu:
        gate, up = h.chunk(2, dim=-1)
        d_up = da * F.silu(gate)
        d_gate = torch.ops.aten.silu_backward(da * up, gate)
        return torch.cat([d_gate, d_up], dim=-1)
    return torch.ops.aten.gelu_backward(da, h, approximate="tanh")


class _MiniSequenceMLP(torch.autograd.Function):
    """``act(x W1^T + b1) W2^T`` over row chunks. x ``[N, h]``, W1 ``[f1, h]`` (f1 = 2f for SwiGLU: local
    ``[gate; up]``), b1 ``[f1]`` or None, W2 ``[h_out, f]``. Returns ``[N, h_out]`` (a partial sum under tp; the
    row linear's reduction and bias are applied by the caller)."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2, swiglu: bool, chunk: int):
        dtype = _compute_dtype(x)
        ctx.dtype, ctx.swiglu, ctx.chunk = dtype, swiglu, chunk
        ctx.save_for_backward(x, w1, b1, w2)
        with torch.autocast(x.device.type, enabled=False):
            xc_, w1c, b1c, w2c = _cast(x, dtype), _cast(w1, dtype), _cast(b1, dtype), _cast(w2, dtype)
            out = torch.empty(x.shape[0], w2.shape[0], dtype=dtype, device=x.device)
            for i0, i1 in chunk_bounds(x.shape[0], chunk):
                a = _activation(F.linear(xc_[i0:i1], w1c, b1c), swiglu)
                torch.mm(a, w2c.t(), out=out[i0:i1])
        return out

    @staticmethod
    def backward(ctx, g):
        x, w1, b1, w2 = ctx.saved_tensors
        dtype, swiglu = ctx.dtype, ctx.swiglu
        need_x = ctx.needs_input_grad[0]
        dx = torch.empty_like(x) if need_x else None
        dw1 = torch.zeros_like(w1) if ctx.needs_input_grad[1] else None
        db1 = torch.zeros_like(b1) if b1 is not None and ctx.needs_input_grad[2] else None
        dw2 = torch.zeros_like(w2) if ctx.needs_input_grad[3] else None
        with torch.autocast(x.device.type, enabled=False):
            xc_, w1c, b1c, w2c, g = _cast(x, dtype), _cast(w1, dtype), _cast(b1, dtype), _cast(w2, dtype), _cast(g, dtype)
            for i0, i1 in chunk_bounds(x.shape[0], ctx.chunk):
                xi, gi = xc_[i0:i1], g[i0:i1]
                h = F.linear(xi, w1c, b1c)  # recomputed: [n, f1] lives for this chunk only
                if dw2 is not None:
                    _accumulate_mm(dw2, gi.t(), _activation(h, swiglu))
                dh = _activation_backward(gi.mm(w2c), h, swiglu)
                del h
                if dw1 is not None:
                    _accumulate_mm(dw1, dh.t(), xi)
                if db1 is not None:
                    db1.add_(dh.sum(dim=0).to(db1.dtype))
                if need_x:
                    dx[i0:i1] = dh.mm(w1c)
        return dx, dw1, db1, dw2, None, None


def mini_sequence_mlp(x: torch.Tensor, w1: torch.Tensor, b1: Optional[torch.Tensor], w2: torch.Tensor,
                      swiglu: bool, chunk: int) -> torch.Tensor:
    """MLP without its tp communication and output bias, over chunks of ``chunk`` rows of ``x [N, h]``."""
    return _MiniSequenceMLP.apply(x, w1, b1, w2, swiglu, chunk)


# ---- LM head + cross entropy -------------------------------------------------------------------------------------
def _target_mask(labels: torch.Tensor, per: int, start: int, ignore_index: int):
    """Local column of each label in this vocab shard and whether the label lives here (and is not ignored)."""
    local = labels - start
    in_shard = (local >= 0) & (local < per) & (labels != ignore_index)
    return local.clamp(0, per - 1).unsqueeze(-1), in_shard


class _MiniSequenceLinearCE(torch.autograd.Function):
    """Per-token cross entropy of ``x W^T`` over row chunks, W sharded over the vocab on tp (rank t holds rows
    ``[t*V/tp, (t+1)*V/tp)``). x ``[N, h]`` (identical on the tp ranks), labels ``[N]`` global ids, ``-100``
    ignored (loss 0, no gradient). Returns fp32 ``[N]``. Logits ``[n, V/tp]`` exist for one chunk at a time.

    Forward keeps x, W, labels and the per-token log-sum-exp ``[N]`` (4 bytes a token); backward recomputes each
    chunk's logits, turns them into ``softmax - onehot`` with the saved lse (no collective) and returns
    ``dx`` (partial over tp, reduced by the caller's input mapping) and ``dW`` summed over the chunks."""

    @staticmethod
    def forward(ctx, x, weight, labels, topo: Topology, chunk: int, ignore_index: int):
        dtype = _compute_dtype(x)
        per = weight.shape[0]
        start = topo.tp_rank * per
        n = x.shape[0]
        loss = torch.empty(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            xc_, wc = _cast(x, dtype), _cast(weight, dtype)
            for i0, i1 in chunk_bounds(n, chunk):
                logits = xc_[i0:i1].mm(wc.t()).float()
                vmax = logits.max(dim=-1).values
                all_reduce(vmax, topo, Axis.TP, op=torch.distributed.ReduceOp.MAX)
                logits.sub_(vmax.unsqueeze(-1))
                idx, in_shard = _target_mask(labels[i0:i1], per, start, ignore_index)
                sums = torch.stack([torch.gather(logits, -1, idx).squeeze(-1) * in_shard, logits.exp_().sum(dim=-1)])
                del logits
                all_reduce(sums, topo, Axis.TP)
                valid = labels[i0:i1] != ignore_index
                log_z = torch.log(sums[1])
                loss[i0:i1] = (log_z - sums[0]) * valid
                lse[i0:i1] = log_z + vmax
        ctx.save_for_backward(x, weight, labels, lse)
        ctx.dtype, ctx.chunk, ctx.start, ctx.ignore_index = dtype, chunk, start, ignore_index
        return loss

    @staticmethod
    def backward(ctx, g):
        x, weight, labels, lse = ctx.saved_tensors
        dtype, per = ctx.dtype, weight.shape[0]
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        scale = g.float() * (labels != ctx.ignore_index)
        with torch.autocast(x.device.type, enabled=False):
            xc_, wc = _cast(x, dtype), _cast(weight, dtype)
            for i0, i1 in chunk_bounds(x.shape[0], ctx.chunk):
                xi = xc_[i0:i1]
                grad = xi.mm(wc.t()).float()  # recomputed logits, turned in place into d loss / d logits
                grad.sub_(lse[i0:i1].unsqueeze(-1)).exp_()
                idx, in_shard = _target_mask(labels[i0:i1], per, ctx.start, ctx.ignore_index)
                grad.scatter_add_(-1, idx, -in_shard.to(grad.dtype).unsqueeze(-1))
                grad.mul_(scale[i0:i1].unsqueeze(-1))
                grad = _cast(grad, dtype)
                if dw is not None:
                    _accumulate_mm(dw, grad.t(), xi)
                if dx is not None:
                    dx[i0:i1] = grad.mm(wc)
        return dx, dw, None, None, None, None


def mini_sequence_cross_entropy(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, topo: Topology,
                                chunk: int, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[N]`` (fp32) of the vocab-parallel head ``x [N, h] @ weight[V/tp, h]^T`` against global
    ``labels [N]``, over chunks of ``chunk`` rows."""
    return _MiniSequenceLinearCE.apply(x, weight, labels, topo, chunk, ignore_index)
