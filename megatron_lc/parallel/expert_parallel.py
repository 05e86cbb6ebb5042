"""Expert parallelism: an MoE layer's experts sharded over the ranks of an expert group (``Axis.EP``: ep consecutive
ranks of a dp x cp group, ``topology.py``), each token's copies sent to the ranks of the experts it is routed to
and back, by all-to-all (``parallel.expert_model_parallel_size``). Dropless: every copy is sent, whatever the load.

Example, 8 experts, ep = 2, top-2: rank 0 holds experts 0-3, rank 1 experts 4-7. Rank 0's 3 tokens route to
(1, 5), (5, 6), (0, 1): its 6 copies sorted by expert are ``[e0, e1, e1, e5, e5, e6]``, counts ``[1, 2, 0, 0 | 0,
2, 1, 0]``. First the counts go across (one all-to-all of ``[ep, E/ep]`` integers: each rank learns how many rows of
each of its experts every rank sends), then the rows: rank 0 keeps 3 and sends 3 to rank 1. A rank receives its
rows in blocks (source rank, local expert) and regroups them by local expert (``_regroup``) so each expert's rows
are contiguous for the grouped matmul; ``combine`` undoes the regrouping and sends every row back to where it came
from. The backward of each all-to-all is the same exchange with the split sizes swapped (``_AllToAllV``).

The split sizes are host integers: the one device-to-host read of the exchange is the counts after their
all-to-all (as in Megatron-LM's all-to-all dispatcher). Without values (a rehearsal's fake tensors) the exchange
takes the stated worst case instead (``split_sizes``): this rank sends its copies evenly and, as the busiest expert
rank, receives ``config.moe.EXPERT_LOAD`` times its fair share, evenly from every rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..config.moe import EXPERT_LOAD
from ..device import has_values
from .collectives import all_to_all, all_to_all_v
from .tensor_parallel import replicated_parameter
from .topology import Axis, Topology


TAG = "experts"  # the exchanges' bytes in ``topo.comm``: ``experts.fwd`` / ``experts.bwd`` (the counts' in forward)


class _AllToAllV(torch.autograd.Function):
    """Forward: rows ``send[j]`` to expert rank j, ``recv[j]`` received from it; backward: the gradient rows back the
    same way, the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, send, recv, topo):
        ctx.splits, ctx.topo = (send, recv), topo
        with topo.comm.tag(TAG + ".fwd"):
            return all_to_all_v(x, send, recv, topo, Axis.EP)

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.splits
        with ctx.topo.comm.tag(TAG + ".bwd"):
            return all_to_all_v(g.contiguous(), recv, send, ctx.topo, Axis.EP), None, None, None


def expert_parameter(p: nn.Parameter, init: tuple, sequence_parallel: bool) -> nn.Parameter:
    """``p`` marked as this expert rank's slice (dim 0: its experts) of the full ``[E, ...]`` tensor: replicated
    over tp (its gradient partial over tp under SP), summed over the expert-data ranks (``Axis.EDP``), never
    over the other expert ranks."""
    replicated_parameter(p, init, sequence_parallel)
    p.expert_parallel = True
    return p


def is_expert(p: torch.Tensor) -> bool:
    return bool(getattr(p, "expert_parallel", False))


def expert_full_shape(p: torch.Tensor, shape: tuple, topo: Topology) -> tuple:
    """The full tensor's shape of parameter ``p`` whose tp-full shape is ``shape``: every expert (dim 0 times ep)."""
    return (shape[0] * topo.ep, *shape[1:]) if is_expert(p) else shape


def expert_shard(full: torch.Tensor, p: torch.Tensor, topo: Topology) -> torch.Tensor:
    """This expert rank's experts of ``full`` (``full`` itself for a parameter that is not an expert's)."""
    return full.chunk(topo.ep, dim=0)[topo.axis_rank(Axis.EP)] if is_expert(p) and topo.ep > 1 else full


@dataclass
class Exchange:
    """What ``combine`` needs of one ``dispatch``: the split sizes (rows to / from each expert rank) and the order
    that regrouped the received rows by local expert."""

    send: list
    recv: list
    order: torch.Tensor


class ExpertDispatcher:
    """Moves the rows of one MoE call to the ranks of their experts and back (see module doc); with ep = 1 both
    directions are the identity. ``num_experts``: the layer's experts, ``num_experts / ep`` on each rank, rank e
    holding ``[e * E/ep, (e + 1) * E/ep)``."""

    def __init__(self, topo: Topology, num_experts: int):
        self.topo, self.ep = topo, topo.ep
        self.num_local = num_experts // topo.ep
        self.first = topo.axis_rank(Axis.EP) * self.num_local  # this rank's first expert

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                          Optional[Exchange]]:
        """``rows [M, h]`` sorted by expert (expert 0's first) and ``counts [E]`` (int64, on the device) -> (the
        rows of this rank's experts ``[M', h]`` grouped by local expert, their counts ``[E/ep]``, the exchange)."""
        if self.ep == 1:
            return rows, counts, None
        sent = counts.view(self.ep, self.num_local)  # row j: the counts of rank j's experts
        with self.topo.comm.tag(TAG + ".fwd"):  # row j of ``got``: rank j's counts of my experts
            got = all_to_all(sent, self.topo, Axis.EP, scatter_dim=0, gather_dim=0)
        send, recv = self.split_sizes(sent, got, rows.shape[0])
        received = _AllToAllV.apply(rows, send, recv, self.topo)  # blocks (source rank, local expert)
        order = _regroup(got, sum(recv))
        return received[order], got.sum(0), Exchange(send, recv, order)

    def split_sizes(self, sent: torch.Tensor, got: torch.Tensor, copies: int) -> tuple[list, list]:
        """(rows to each expert rank, rows from each): the counts read on the host (the exchange's one read), or
        without values the stated worst case (module doc)."""
        if has_values(got):
            return torch.stack([sent.sum(1), got.sum(1)]).tolist()
        even = [copies // self.ep + (j < copies % self.ep) for j in range(self.ep)]
        busiest = round(copies * EXPERT_LOAD / self.ep)
        return even, [busiest] * self.ep

    def combine(self, rows: torch.Tensor, exchange: Optional[Exchange]) -> torch.Tensor:
        """The inverse of ``dispatch``: this rank's experts' output rows ``[M', h]`` (grouped by local expert) back to
        the ranks they came from; returns this rank's rows ``[M, h]`` in the order ``dispatch`` was given them."""
        if exchange is None:
            return rows
        inverse = torch.empty_like(exchange.order)
        inverse[exchange.order] = torch.arange(len(exchange.order), device=inverse.device)
        return _AllToAllV.apply(rows[inverse], exchange.recv, exchange.send, self.topo)


def _regroup(got: torch.Tensor, rows: int) -> torch.Tensor:
    """The row order that turns received blocks ``(source s, local expert j)`` (sizes ``got[s, j]``, source-major)
    into local-expert-major blocks ``(j, s)``. Example, 2 sources, 2 experts, ``got = [[1, 2], [0, 1]]``: rows
    ``[s0e0, s0e1, s0e1, s1e1]`` -> order ``[0, 1, 2, 3]`` -> expert 0's row, then expert 1's three (s0, s0, s1)."""
    ep, local = got.shape
    blocks = torch.arange(ep * local, device=got.device)
    block = torch.repeat_interleave(blocks, got.flatten(), output_size=rows)  # each row's block (s * local + j)
    key = (block % local) * ep + block // local  # its place in (j, s) order
    return torch.argsort(key, stable=True)
