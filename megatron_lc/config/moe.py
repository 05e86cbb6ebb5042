"""The mixture-of-experts keys of the ``model:`` section: their checks, the per-layer pattern and the parameter
count of an MoE layer (``model/moe.py`` builds the layer; ``docs/moe.md``).

Example, Qwen3-30B-A3B: ``num_moe_experts: 128, moe_router_topk: 8, moe_ffn_hidden_size: 768`` on every one of its
48 layers (``moe_layer_freq: 1``); Qwen1.5-MoE-A2.7B adds ``moe_shared_expert_intermediate_size: 5632,
moe_shared_expert_gate: true`` and ``moe_router_pre_softmax: true``; Mixtral 8x7B is ``num_moe_experts: 8,
moe_router_topk: 2``."""
from __future__ import annotations

from .base import check

# The dropless MoE's assumed worst case under expert parallelism, for what cannot see the router's choices (the
# estimator, a rehearsal's exchange without values): the busiest expert rank receives this times its fair share of
# the copies. An assumption, not a bound -- the router decides. The load-balancing loss at Hugging Face's
# coefficients (1e-3 to 1e-2) keeps a trained router's per-rank load within tens of percent of the mean when each
# rank holds many experts; with the aux loss off, or few experts a rank, it can be far worse.
EXPERT_LOAD = 1.25


def moe_layer_pattern(m) -> tuple:
    """Which of ``m``'s layers are MoE, as booleans (``ModelConfig.moe_layers``)."""
    if m.num_moe_experts is None:
        return (False,) * m.num_layers
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(m.num_layers))
    return tuple(bool(x) for x in freq)


def expert_ffn(m) -> int:
    """One expert's SwiGLU width: ``moe_ffn_hidden_size``, or ``ffn_hidden_size`` unset."""
    return m.moe_ffn_hidden_size or m.ffn_hidden_size


def moe_layer_parameters(m, active: bool = False) -> int:
    """Parameters of one MoE layer's MLP: the router ``[E, h]``, the experts (``[2f, h] + [h, f]`` each; of them
    the top-k when ``active``), the shared expert and its gate."""
    h, f = m.hidden_size, expert_ffn(m)
    experts = m.moe_router_topk if active else m.num_moe_experts
    shared = 3 * h * (m.moe_shared_expert_intermediate_size or 0) + (h if m.moe_shared_expert_gate else 0)
    return m.num_moe_experts * h + experts * 3 * h * f + shared


def check_moe(m) -> None:
    """One-line errors for the MoE keys of model section ``m`` (called by ``ModelConfig.__post_init__``)."""
    named = [k for k in ("moe_ffn_hidden_size", "moe_z_loss_coeff", "moe_shared_expert_intermediate_size")
             if getattr(m, k) is not None] + [k for k in ("moe_aux_loss_coeff",) if getattr(m, k)]
    if m.num_moe_experts is None:
        check(not named and not m.moe_shared_expert_gate,
              f"model.{(named or ['moe_shared_expert_gate'])[0]} is set but model.num_moe_experts is not: the MoE "
              f"keys need experts")
        return
    e, k = m.num_moe_experts, m.moe_router_topk
    check(e >= 1, f"model.num_moe_experts ({e}) must be >= 1")
    check(1 <= k <= e, f"model.moe_router_topk ({k}) must be between 1 and model.num_moe_experts ({e})")
    check(m.moe_ffn_hidden_size is None or m.moe_ffn_hidden_size > 0,
          f"model.moe_ffn_hidden_size ({m.moe_ffn_hidden_size}) must be positive")
    check(m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff ({m.moe_aux_loss_coeff}) must be >= 0")
    check(m.moe_z_loss_coeff is None or m.moe_z_loss_coeff >= 0,
          f"model.moe_z_loss_coeff ({m.moe_z_loss_coeff}) must be >= 0")
    check(m.gated_linear_unit and m.swiglu,
          "model.num_moe_experts with a GeLU / GeGLU MLP: the experts are SwiGLU (set swiglu and gated_linear_unit "
          "true)")
    check(not m.add_bias_linear, "model.num_moe_experts with model.add_bias_linear: the experts have no biases")
    check(m.moe_shared_expert_intermediate_size is None or m.moe_shared_expert_intermediate_size > 0,
          f"model.moe_shared_expert_intermediate_size ({m.moe_shared_expert_intermediate_size}) must be positive")
    check(not m.moe_shared_expert_gate or m.moe_shared_expert_intermediate_size is not None,
          "model.moe_shared_expert_gate without model.moe_shared_expert_intermediate_size: there is no shared "
          "expert to gate")
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        check(freq >= 1, f"model.moe_layer_freq ({freq}) must be >= 1 (every N-th layer MoE)")
    else:
        check(len(freq) == m.num_layers and set(freq) <= {0, 1},
              f"model.moe_layer_freq {list(freq)} must have one 0 (dense) or 1 (MoE) per layer "
              f"(model.num_layers = {m.num_layers})")
