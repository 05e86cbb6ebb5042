"""Tensor parallelism (Megatron-style) with optional Megatron sequence parallelism, on any device.

Why not megatron-core's ``ColumnParallelLinear``/``RowParallelLinear``: they run on CPU, but they hard-wire their
communication inside ``forward`` (all-reduce on the tp group) and their sequence-parallel mappings allocate on CUDA,
so SP, CP and the memory techniques could not choose the communication. The layers here are small and their
mappings are explicit; tests check them against ``nn.Linear`` / ``F.cross_entropy`` forward and backward.

Shapes are sequence-first ``[s, b, h]`` (Megatron). With tp=2 and sequence parallel, rank t holds tokens
``[t*s/2, (t+1)*s/2)`` of the hidden states between blocks; a column linear all-gathers them (backward:
reduce-scatter), a row linear reduce-scatters its partial sums (backward: all-gather).

Every sharded parameter carries ``tensor_model_parallel = True`` and ``partition = (dim, stride)``: the full tensor's
``dim`` is cut into ``stride`` blocks and each block into tp pieces; rank t holds piece t of every block. This lets
``init`` build the same full model for any tp (``model/init.py``) and checkpoint tools merge shards.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather, all_reduce, reduce_scatter
from .topology import Axis, Topology


# ---- autograd mappings -------------------------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce over tp (input of a column linear without SP)."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous().clone(), ctx.topo, Axis.TP), None


class _ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce over tp, backward identity (output of a row linear without SP)."""

    @staticmethod
    def forward(ctx, x, topo):
        return all_reduce(x.contiguous().clone(), topo, Axis.TP)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    """Forward all-gather along dim 0 over tp, backward reduce-scatter (input of a column linear with SP)."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return all_gather(x, topo, Axis.TP, dim=0)

    @staticmethod
    def backward(ctx, g):
        return reduce_scatter(g, ctx.topo, Axis.TP, dim=0), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Forward reduce-scatter along dim 0 over tp, backward all-gather (output of a row linear with SP)."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return reduce_scatter(x, topo, Axis.TP, dim=0)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.topo, Axis.TP, dim=0), None


class _ScatterToSP(torch.autograd.Function):
    """Forward keep this rank's slice of dim 0, backward all-gather."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x.chunk(topo.tp, dim=0)[topo.tp_rank].contiguous()

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.topo, Axis.TP, dim=0), None


def copy_to_tp(x, topo):
    return x if topo.tp == 1 else _CopyToTP.apply(x, topo)


def reduce_from_tp(x, topo):
    return x if topo.tp == 1 else _ReduceFromTP.apply(x, topo)


def gather_from_sp(x, topo):
    return x if topo.tp == 1 else _GatherFromSP.apply(x, topo)


def reduce_scatter_to_sp(x, topo):
    return x if topo.tp == 1 else _ReduceScatterToSP.apply(x, topo)


def scatter_to_sp(x, topo):
    return x if topo.tp == 1 else _ScatterToSP.apply(x, topo)


# ---- layers ------------------------------------------------------------------------------------------------------
def _mark(p: nn.Parameter, dim: int, stride: int = 1, init: tuple = ("normal", 0.02)) -> nn.Parameter:
    p.tensor_model_parallel = True
    p.partition = (dim, stride)
    p.init = init
    return p


def replicated_parameter(p: nn.Parameter, init: tuple, sequence_parallel: bool = False) -> nn.Parameter:
    """``p`` marked as whole on every tp rank, with its init rule (e.g. ``("ones",)`` for a norm's weight)."""
    p.tensor_model_parallel = False
    p.init = init
    p.sequence_parallel = sequence_parallel  # grads are partial per tp rank under SP -> all-reduced over tp
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+b) with W's output dim sharded over tp; output stays sharded (no gather)."""

    def __init__(self, in_features: int, out_features: int, topo: Topology, *, bias: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, init_std: float = 0.02):
        super().__init__()
        if out_features % (topo.tp * stride) != 0:
            raise ValueError(f"output size {out_features} not divisible by tp ({topo.tp}) x stride ({stride})")
        self.topo, self.sequence_parallel = topo, sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features // topo.tp, in_features)), 0, stride,
                            ("normal", init_std))
        self.bias = _mark(nn.Parameter(torch.empty(out_features // topo.tp)), 0, stride, ("zeros",)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sp(x, self.topo) if self.sequence_parallel else copy_to_tp(x, self.topo)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T (+b) with W's input dim sharded over tp; partial sums reduced (all-reduce, or reduce-scatter
    along the sequence with SP)."""

    def __init__(self, in_features: int, out_features: int, topo: Topology, *, bias: bool = False,
                 sequence_parallel: bool = False, init_std: float = 0.02):
        super().__init__()
        if in_features % topo.tp != 0:
            raise ValueError(f"input size {in_features} not divisible by tp ({topo.tp})")
        self.topo, self.sequence_parallel = topo, sequence_parallel
        self.weight = _mark(nn.Parameter(torch.empty(out_features, in_features // topo.tp)), 1, 1,
                            ("normal", init_std))
        self.bias = (replicated_parameter(nn.Parameter(torch.empty(out_features)), ("zeros",), sequence_parallel)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = reduce_scatter_to_sp(y, self.topo) if self.sequence_parallel else reduce_from_tp(y, self.topo)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary sharded over tp: rank t holds rows [t*V/tp, (t+1)*V/tp).
    Input tokens ``[s, b]`` -> ``[s, b, h]`` (or ``[s/tp, b, h]`` with SP)."""

    def __init__(self, num_embeddings: int, dim: int, topo: Topology, *, sequence_parallel: bool = False,
                 init_std: float = 0.02):
        super().__init__()
        if num_embeddings % topo.tp != 0:
            raise ValueError(f"vocab {num_embeddings} not divisible by tp ({topo.tp})")
        self.topo, self.sequence_parallel = topo, sequence_parallel
        self.per_rank = num_embeddings // topo.tp
        self.start = topo.tp_rank * self.per_rank
        self.weight = _mark(nn.Parameter(torch.empty(self.per_rank, dim)), 0, 1, ("normal", init_std))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.topo.tp == 1:
            out = F.embedding(tokens, self.weight)
        else:
            local = tokens - self.start
            outside = (local < 0) | (local >= self.per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.topo)
        return reduce_from_tp(out, self.topo)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy of logits sharded over the vocab (rank t holds columns [t*V/tp, (t+1)*V/tp)).
    Labels equal to ``ignore_index`` give loss 0 and no gradient."""

    @staticmethod
    def forward(ctx, logits, labels, topo, ignore_index):
        logits = logits.float()
        vmax = logits.max(dim=-1).values
        all_reduce(vmax, topo, Axis.TP, op=torch.distributed.ReduceOp.MAX)
        shifted = logits - vmax.unsqueeze(-1)
        per = logits.shape[-1]
        start = topo.tp_rank * per
        local = labels - start
        in_shard = (local >= 0) & (local < per) & (labels != ignore_index)
        idx = local.clamp(0, per - 1).unsqueeze(-1)
        target_logit = torch.gather(shifted, -1, idx).squeeze(-1) * in_shard
        all_reduce(target_logit, topo, Axis.TP)
        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, topo, Axis.TP)
        loss = torch.log(sum_exp) - target_logit
        valid = labels != ignore_index
        loss = loss * valid
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, idx, in_shard, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, in_shard, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, idx, -in_shard.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g * valid).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, topo: Topology,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (fp32) of ``logits[..., V/tp]`` against global ``labels[...]``."""
    return _VocabParallelCrossEntropy.apply(logits, labels, topo, ignore_index)


def param_is_replicated_grad_partial(p: nn.Parameter) -> bool:
    """True for replicated params whose grads must be all-reduced over tp (norms and row biases under SP)."""
    return bool(getattr(p, "sequence_parallel", False))


def cut_shard(full: torch.Tensor, partition: Optional[tuple], tp: int, tp_rank: int) -> torch.Tensor:
    """tp rank ``tp_rank``'s piece of ``full`` for ``partition = (dim, stride)`` (None: replicated, the whole)."""
    if partition is None or tp == 1:
        return full
    dim, stride = partition
    blocks = full.chunk(stride, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[tp_rank] for b in blocks], dim=dim)


def tp_partition(p: torch.Tensor) -> Optional[tuple]:
    """``(dim, stride)`` of a parameter cut over tp (``_mark``), None for a replicated one."""
    return p.partition if getattr(p, "tensor_model_parallel", False) else None


def shard_full_tensor(full: torch.Tensor, p: nn.Parameter, topo: Topology) -> torch.Tensor:
    """This rank's piece of ``full`` according to ``p.partition`` (identity for replicated params)."""
    return cut_shard(full, tp_partition(p), topo.tp, topo.tp_rank)


def full_shape(p: nn.Parameter, tp: int) -> tuple:
    shape = list(p.shape)
    if getattr(p, "tensor_model_parallel", False):
        shape[p.partition[0]] *= tp
    return tuple(shape)


def merge_shards(shards: list, partition: Optional[tuple]) -> torch.Tensor:
    """Inverse of ``shard_full_tensor``: tp shards (rank order) -> full tensor."""
    if partition is None or len(shards) == 1:
        return shards[0]
    dim, stride = partition
    per_rank_blocks = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank_blocks], dim=dim) for i in range(stride)], dim=dim)


def init_std_for_output(std: float, num_layers: int) -> float:
    """Megatron's scaled init for the layers that write into the residual stream."""
    return std / math.sqrt(2.0 * num_layers)
