"""The routers' losses: Hugging Face's load-balancing loss over every MoE layer of a forward, and the router z-loss,
given to the routers as gradients.

Hugging Face's loss of one forward (``load_balancing_loss_func`` with ``router_aux_loss_coef``): over its R router
rows (tokens x MoE layers), with C_e the top-k selections of expert e and P_e the sum of expert e's softmax
probability,

    aux = E * sum_e (C_e / R) * (P_e / R),        d aux / d p[row, e] = E * C_e / R^2

C is a count (no gradient), so every row's gradient is the same vector, known once every layer has routed. The
layers record C, P and their rows as they route (``add``); the model all-reduces them once after its last layer
(``finish``, over every rank holding tokens of the micro-batch: dp x cp, and tp under sequence parallelism); each MoE
call's output carries a node (``attach``) whose backward hands the call's probabilities ``coeff * E * C / R^2 /
micro-batches``: the gradient of ``coeff`` times the mean over the step's micro-batches of the aux loss of the whole
micro-batch (every dp and cp rank's tokens together), so it is the one-process model's whatever the layout.
Example, E = 4, top-2, 2 MoE layers, a micro-batch of 3 tokens on each of 2 cp ranks: R = 12, and each row's
gradient is ``coeff * 4 * C / 144`` with C summed over both ranks -- not over the 6 rows a rank holds.

Re-runs: a layer run again in backward (token-wise recompute, Memo, host checkpoints, MsT's chunks) routes its rows
again; that is not recorded (it runs inside the autograd engine: ``comm_stats.in_backward``), and its node
gives its rows their gradient then; a forward run without a graph (Memo's recomputed rows) is recorded and has no
node. A layer run outside the model's forward (a calibration's probe) finds no total and adds no router gradient.

z-loss (ST-MoE; Megatron-LM's ``moe_z_loss_coeff``): per MoE layer ``coeff * mean over the micro-batch's tokens of
logsumexp(logits)^2``, summed over the layers: d / d lse = 2 coeff lse / T.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..parallel.collectives import all_reduce
from ..parallel.comm_stats import in_backward
from ..parallel.topology import Axis, Topology


class RoutingRecord:
    """The routers' counts of one forward and the gradients they give (see module doc). The default one (no
    experts) records nothing. ``micro_batches``: of a step (the gradients are of the mean over them)."""

    def __init__(self, num_experts: int = 0, aux_coeff: float = 0.0, z_coeff: Optional[float] = None,
                 moe_layers: int = 0, micro_batches: int = 1, sequence_parallel: bool = False):
        self.num_experts, self.aux_coeff, self.z_coeff = num_experts, aux_coeff, z_coeff or 0.0
        self.moe_layers, self.micro_batches, self.sequence_parallel = moe_layers, micro_batches, sequence_parallel
        self.local: Optional[torch.Tensor] = None  # [C (E), P (E), sum lse^2, rows] of this rank, fp64
        self.total: Optional[torch.Tensor] = None  # the same summed over the micro-batch's ranks (``finish``)

    @property
    def trains(self) -> bool:
        """Whether the routers get a loss gradient (a coefficient is set)."""
        return self.aux_coeff > 0 or self.z_coeff > 0

    def begin(self) -> None:
        """A forward starts: nothing recorded yet."""
        self.local = self.total = None

    def add(self, counts: torch.Tensor, probs: torch.Tensor, lse: Optional[torch.Tensor]) -> None:
        """One MoE call's routing: ``counts [E]`` the top-k selections per expert, ``probs [T, E]`` the softmax over
        all experts, ``lse [T]`` the logits' logsumexp (None without a z-loss). Not recorded when re-run in
        backward."""
        if in_backward():  # a re-run of a recorded call
            return
        with torch.no_grad():
            e = self.num_experts
            v = torch.zeros(2 * e + 2, dtype=torch.float64, device=probs.device)
            v[:e] = counts
            v[e:2 * e] = probs.sum(0, dtype=torch.float64)
            if lse is not None:
                v[2 * e] = lse.double().square().sum()
            v[2 * e + 1] = probs.shape[0]
            self.local = v if self.local is None else self.local + v

    def finish(self, topo: Topology) -> None:
        """The forward's last layer has routed: the counts summed over the micro-batch's ranks (one all-reduce;
        nothing without an MoE layer)."""
        if self.local is None:
            return
        total = self.local.clone()
        all_reduce(total, topo, Axis.DP_CP)
        if self.sequence_parallel:  # each tp rank routed its own share of the tokens
            all_reduce(total, topo, Axis.TP)
        self.total = total

    def aux_loss(self) -> Optional[torch.Tensor]:
        """Hugging Face's load-balancing loss of the last forward (0-dim fp64, before the coefficient), None
        before ``finish``."""
        if self.total is None:
            return None
        e = self.num_experts
        c, p, rows = self.total[:e], self.total[e:2 * e], self.total[-1]
        return e * (c * p).sum() / rows.square()

    def z_loss(self) -> Optional[torch.Tensor]:
        """The z-loss of the last forward, summed over the MoE layers (before the coefficient)."""
        if self.total is None:
            return None
        return self.total[2 * self.num_experts] * self.moe_layers / self.total[-1]

    def attach(self, out: torch.Tensor, probs: torch.Tensor, lse: Optional[torch.Tensor]) -> torch.Tensor:
        """``out`` (the call's output), with a node whose backward gives ``probs`` and ``lse`` their loss
        gradients; ``out`` itself without a coefficient or a graph."""
        if not self.trains or not torch.is_grad_enabled():
            return out
        return _RouterLossGradient.apply(out, probs, lse, self)

    def gradients(self, shape: torch.Size, like: torch.Tensor, lse: Optional[torch.Tensor]):
        """(d loss / d probs ``shape``, in ``like``'s dtype and device; d loss / d lse) of one call (zeros
        without a total)."""
        if self.total is None:
            return like.new_zeros(shape), None if lse is None else torch.zeros_like(lse)
        e, rows = self.num_experts, self.total[-1]
        scale = self.aux_coeff * e / (self.micro_batches * rows.square())
        d_probs = (self.total[:e] * scale).to(like.dtype).expand(shape)  # the same for every row
        d_lse = None
        if lse is not None:  # 2 coeff lse / T, T = the micro-batch's tokens (rows of one layer)
            d_lse = lse * (2 * self.z_coeff * self.moe_layers / (self.micro_batches * rows)).to(lse.dtype)
        return d_probs, d_lse


class _RouterLossGradient(torch.autograd.Function):
    """Forward: ``out`` as it is; backward: ``out``'s gradient through, and the router losses' gradients into the
    call's probabilities and logsumexp (Megatron-LM's auxiliary-loss scaler does the same for its per-layer
    loss). Saves only ``lse`` (the probabilities' gradient does not depend on them)."""

    @staticmethod
    def forward(ctx, out, probs, lse, record):
        ctx.record, ctx.shape, ctx.like = record, probs.shape, probs.new_empty(0)
        ctx.save_for_backward(lse)
        return out

    @staticmethod
    def backward(ctx, g):
        (lse,) = ctx.saved_tensors
        d_probs, d_lse = ctx.record.gradients(ctx.shape, ctx.like, lse)
        return g, d_probs, d_lse, None
