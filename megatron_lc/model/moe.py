"""Mixture of experts: the MLP of the layers ``model.moe_layer_freq`` names (the spec builds ``MoE`` there, in the
MLP's place and with its constructor: ``compose/spec.py``). Dropless: no capacity, every token reaches its top-k
experts whatever the load.

    x [s, b, h]     (s/tp rows under sequence parallelism: each tp rank routes its own share of the tokens; the
                     experts are whole on every tp rank, their gradients summed over tp like a norm's)
    router          logits = x W_r^T [T, E] -> softmax in fp32 -> top-k; the k weights renormalised to sum to 1
                    (Qwen3-MoE's norm_topk_prob, Mixtral) unless model.moe_router_pre_softmax (Qwen2-MoE)
    copies          the T*k (token, expert) copies sorted by expert, their counts [E] -> the dispatcher
                    (``parallel/expert_parallel.py``: to the experts' ranks by all-to-all under ep, else as they are)
    experts         [gate; up] = grouped matmul of each expert's rows with its W1 -> silu(gate) * up -> with its W2
    combine         back to their ranks, in token order [T, k, h], weighted sum over k
    (shared)        + sigmoid(x w_g) * shared_mlp(x)      (Qwen2-MoE's shared expert and its gate)

The load-balancing and z-losses reach the router through ``moe_loss.RoutingRecord`` (the model's context's).
Example, Qwen3-30B-A3B at 2M tokens on 8 ranks (cp 8, ep 8): a rank routes its 262144 tokens to 8 of 128 experts,
2M copies, and holds 16 experts' weights per layer."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import ModelConfig
from ..config.moe import expert_ffn
from ..device import has_values
from ..parallel.expert_parallel import expert_parameter
from ..parallel.tensor_parallel import replicated_parameter
from .mlp import activate


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The autocast dtype of ``t``'s device when autocast is on (the grouped matmul has no autocast rule), else
    ``t``'s."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _grouped_mm_runs(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """``torch._grouped_mm`` takes these: on the CPU any float dtype, elsewhere bf16 (its CUDA kernel's); rows of
    16-byte multiples."""
    aligned = all(n * rows.element_size() % 16 == 0 for n in weight.shape[1:])
    return aligned and (rows.device.type == "cpu" or rows.dtype == torch.bfloat16)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows [M, in]`` in groups (``counts[g]`` rows of group g, group 0's first) times ``weight[g] [out, in]``
    transposed -> ``[M, out]``: one grouped matmul (``torch._grouped_mm``), or where it does not run a loop over
    the groups (exact, not fast; it reads the counts on the host -- a rehearsal has none: the rows split evenly,
    the same bytes in all)."""
    if _grouped_mm_runs(rows, weight):
        return torch._grouped_mm(rows, weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
    groups = weight.shape[0]
    sizes = counts.tolist() if has_values(counts) else [
        rows.shape[0] // groups + (g < rows.shape[0] % groups) for g in range(groups)]
    return torch.cat([r @ w.t() for r, w in zip(rows.split(sizes), weight)])


class GroupedExperts(nn.Module):
    """This rank's experts' SwiGLU weights: ``weight1 [E_local, 2f, h]`` (``[gate; up]`` of each expert),
    ``weight2 [E_local, h, f]``, slices of the full ``[E, ...]`` tensors over the expert ranks."""

    def __init__(self, cfg: ModelConfig, num_local: int, sequence_parallel: bool, output_std: float):
        super().__init__()
        h, f = cfg.hidden_size, expert_ffn(cfg)
        self.weight1 = expert_parameter(nn.Parameter(torch.empty(num_local, 2 * f, h)),
                                        ("normal", cfg.init_method_std), sequence_parallel)
        self.weight2 = expert_parameter(nn.Parameter(torch.empty(num_local, h, f)), ("normal", output_std),
                                        sequence_parallel)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``rows [M, h]`` grouped by local expert (``counts [E_local]``, in the compute dtype) -> ``[M, h]``."""
        dtype = rows.dtype
        hidden = grouped_linear(rows, self.weight1.to(dtype), counts)  # [M, 2f]
        return grouped_linear(activate(hidden, "swiglu"), self.weight2.to(dtype), counts)  # [M, h]


class MoE(nn.Module):
    """The MoE MLP (see module doc); ``(cfg, parts, output_std)`` like ``MLP``. ``[s, b, h] -> [s, b, h]``."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__()
        sp = parts.sequence_parallel
        self.num_experts, self.topk = cfg.num_moe_experts, cfg.moe_router_topk
        self.pre_softmax, self.z_loss = cfg.moe_router_pre_softmax, cfg.moe_z_loss_coeff is not None
        self.routing = parts.ctx.routing  # the model's record of the routers' counts (moe_loss.py)
        self.dispatcher = parts.expert_dispatcher(cfg.num_moe_experts)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_moe_experts, bias=False)
        replicated_parameter(self.router.weight, ("normal", cfg.init_method_std), sp)
        self.experts = GroupedExperts(cfg, self.dispatcher.num_local, sp, output_std)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.moe_shared_expert_intermediate_size is not None:  # the spec's MLP class (MsT's with memory.mst)
            shared = dataclasses.replace(cfg, ffn_hidden_size=cfg.moe_shared_expert_intermediate_size)
            self.shared_expert = parts.spec.mlp(shared, parts, output_std)
            if cfg.moe_shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
                replicated_parameter(self.shared_expert_gate.weight, ("normal", cfg.init_method_std), sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        out = self.routed(x.reshape(s * b, h)).view(s, b, h)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def route(self, x: torch.Tensor):
        """``x [T, h]`` -> (softmax over all experts ``[T, E]`` fp32, top-k weights ``[T, k]``, top-k experts
        ``[T, k]``, the logits' logsumexp ``[T]`` or None without a z-loss), as Hugging Face's routers compute
        them (softmax, top-k, then the k renormalised)."""
        logits = self.router(x).float()
        probs = torch.softmax(logits, dim=-1)
        weights, selected = torch.topk(probs, self.topk, dim=-1)
        if not self.pre_softmax:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, selected, (torch.logsumexp(logits, dim=-1) if self.z_loss else None)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output ``[T, h]`` of ``x [T, h]``: token-wise (MsT cuts it into mini-sequences)."""
        x = x.to(_compute_dtype(x))  # one cast: the router, the k copies and the all-to-alls in the compute dtype
        probs, weights, selected, lse = self.route(x)
        t, k = selected.shape
        flat = selected.flatten()  # copy c: token c // k, its (c % k)-th expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        self.routing.add(counts, probs, lse)
        order = torch.argsort(flat, stable=True)  # the copies grouped by expert
        rows, local_counts, exchange = self.dispatcher.dispatch(x[order // k], counts)
        back = self.dispatcher.combine(self.experts(rows, local_counts), exchange)  # [T*k, h] in ``order``
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(t * k, device=order.device)
        per_copy = back[inverse].view(t, k, -1)  # token-major again
        out = torch.bmm(weights.to(per_copy.dtype).unsqueeze(1), per_copy).squeeze(1)  # sum over k, weighted
        return self.routing.attach(out, probs, lse)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts} (here {self.dispatcher.num_local}), topk={self.topk}"
