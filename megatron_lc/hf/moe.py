"""The mixture-of-experts families' part of the mapping: Qwen3-MoE, Qwen2-MoE (Qwen1.5-MoE) and Mixtral. Their
attention, norms and dense layers are those of Qwen3 / Qwen2 / Mistral (``configs.py``, ``tensors.py``); here are
the MoE fields of ``config.json`` and the expert tensors.

    family     config fields -> model keys                                      tensors of layer i
    Qwen3-MoE  num_experts, num_experts_per_tok, moe_intermediate_size,         mlp.gate, mlp.experts.{e}.
               norm_topk_prob (-> moe_router_pre_softmax = not it),             {gate,up,down}_proj
               decoder_sparse_step + mlp_only_layers (-> moe_layer_freq),
               router_aux_loss_coef (-> moe_aux_loss_coeff)
    Qwen2-MoE  the same, + shared_expert_intermediate_size (its gate always)    + mlp.shared_expert.*, mlp.
                                                                                shared_expert_gate
    Mixtral    num_local_experts, num_experts_per_tok, intermediate_size        block_sparse_moe.gate, block_
               (the experts' width), router_aux_loss_coef; top-k renormalised   sparse_moe.experts.{e}.w1/w3/w2

Our experts are grouped tensors: ``mlp.experts.weight1 [E, 2f, h]`` is each expert's ``[gate; up]`` stacked,
``weight2 [E, h, f]`` its down projections; the router ``mlp.router.weight [E, h]``. Stacking and slicing copy
values, so Hugging Face -> ours -> Hugging Face is bit for bit. Transformers' own router loss is added to its loss
only with ``output_router_logits``; the import keeps ``router_aux_loss_coef`` as ``moe_aux_loss_coeff`` (training
with the model's own coefficient), the export writes it back with ``output_router_logits: false``."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.moe import expert_ffn


@dataclass(frozen=True)
class ExpertNames:
    """How a family names its MoE MLP: the module (``mlp``), the router under it, each expert's gate / up / down
    projections, the config field of the expert count, whether a shared expert (and its gate) is always there."""

    module: str
    gate: str
    up: str
    down: str
    count_field: str
    shared: bool = False


QWEN_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "num_experts")
QWEN2_EXPERTS = ExpertNames("mlp", "gate_proj", "up_proj", "down_proj", "num_experts", shared=True)
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe", "w1", "w3", "w2", "num_local_experts")
# the HF fields the MoE families read here (``configs.py`` refuses them in a dense family)
MOE_FIELDS = ("num_experts", "num_local_experts")


def moe_section_from_hf(hf: dict, names: ExpertNames, problems: list) -> dict:
    """The MoE keys of the ``model:`` section of a MoE family's ``config.json``; what does not fit goes to
    ``problems``."""
    n = hf["num_hidden_layers"]
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if hf.get("router_jitter_noise"):
        problems.append(f"router_jitter_noise={hf['router_jitter_noise']!r} (not implemented)")
    if names.shared and hf.get("qkv_bias") is False:
        problems.append("qkv_bias=False (Qwen2-MoE's q/k/v biases are always there here)")
    out = {"num_moe_experts": experts, "moe_router_topk": hf["num_experts_per_tok"],
           "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0)}
    if names is MIXTRAL_EXPERTS:  # every layer MoE, the top-k renormalised, intermediate_size is the experts'
        return out
    step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
    out.update(moe_ffn_hidden_size=hf["moe_intermediate_size"], moe_router_pre_softmax=not hf.get("norm_topk_prob"),
               moe_layer_freq=1 if all(pattern) else pattern)
    if names.shared:
        out.update(moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                   moe_shared_expert_gate=True)
    return out


def moe_mismatches(names, m) -> list[str]:
    """What of model section ``m`` the family of ``names`` (None: a dense family) cannot say."""
    moe = m.num_moe_experts is not None
    if names is None:
        return [f"model.num_moe_experts={m.num_moe_experts}"] if moe else []
    if not moe:
        return ["model.num_moe_experts unset (a dense model)"]
    out = []
    shared = m.moe_shared_expert_intermediate_size is not None
    if names.shared and not (shared and m.moe_shared_expert_gate):
        out.append("no gated shared expert (model.moe_shared_expert_intermediate_size / moe_shared_expert_gate)")
    if not names.shared and shared:
        out.append(f"model.moe_shared_expert_intermediate_size={m.moe_shared_expert_intermediate_size}")
    if m.moe_z_loss_coeff is not None:
        out.append(f"model.moe_z_loss_coeff={m.moe_z_loss_coeff}")
    if names is MIXTRAL_EXPERTS:
        if not all(m.moe_layers()):
            out.append(f"model.moe_layer_freq={m.moe_layer_freq} (dense layers)")
        if m.moe_router_pre_softmax:
            out.append("model.moe_router_pre_softmax=true")
        if expert_ffn(m) != m.ffn_hidden_size:
            out.append(f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size} (other than ffn_hidden_size)")
    return out


def moe_hf_fields(names: ExpertNames, m) -> dict:
    """The MoE fields of the family's ``config.json`` for model section ``m``."""
    out = {names.count_field: m.num_moe_experts, "num_experts_per_tok": m.moe_router_topk,
           "router_aux_loss_coef": m.moe_aux_loss_coeff, "output_router_logits": False}
    if names is MIXTRAL_EXPERTS:
        return {**out, "intermediate_size": expert_ffn(m), "router_jitter_noise": 0.0}
    out.update(moe_intermediate_size=expert_ffn(m), norm_topk_prob=not m.moe_router_pre_softmax,
               decoder_sparse_step=1, mlp_only_layers=[i for i, moe in enumerate(m.moe_layers()) if not moe])
    if names.shared:
        out.update(shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size, qkv_bias=True)
    return out


def experts_to_hf(state: dict, m, names: ExpertNames, src: str, dst: str) -> dict:
    """Layer ``src``'s MoE tensors (ours, e.g. ``layers.3.``) under the family's names (``model.layers.3.``)."""
    f = expert_ffn(m)
    mod = f"{dst}{names.module}."
    w1, w2 = state[src + "mlp.experts.weight1"], state[src + "mlp.experts.weight2"]
    out = {mod + "gate.weight": state[src + "mlp.router.weight"]}
    for e in range(m.num_moe_experts):
        out[f"{mod}experts.{e}.{names.gate}.weight"] = w1[e, :f]
        out[f"{mod}experts.{e}.{names.up}.weight"] = w1[e, f:]
        out[f"{mod}experts.{e}.{names.down}.weight"] = w2[e]
    if names.shared:
        fs = m.moe_shared_expert_intermediate_size
        fc1 = state[src + "mlp.shared_expert.linear_fc1.weight"]  # [gate; up]
        out[mod + "shared_expert.gate_proj.weight"], out[mod + "shared_expert.up_proj.weight"] = fc1[:fs], fc1[fs:]
        out[mod + "shared_expert.down_proj.weight"] = state[src + "mlp.shared_expert.linear_fc2.weight"]
        out[mod + "shared_expert_gate.weight"] = state[src + "mlp.shared_expert_gate.weight"]
    return out


def experts_from_hf(hf: dict, m, names: ExpertNames, src: str, dst: str) -> dict:
    """The inverse of ``experts_to_hf``: the family's tensors of layer ``src`` as ours of layer ``dst``."""
    mod = f"{src}{names.module}."
    each = range(m.num_moe_experts)
    out = {dst + "mlp.router.weight": hf[mod + "gate.weight"],
           dst + "mlp.experts.weight1": torch.stack([torch.cat([hf[f"{mod}experts.{e}.{names.gate}.weight"],
                                                                hf[f"{mod}experts.{e}.{names.up}.weight"]])
                                                     for e in each]),
           dst + "mlp.experts.weight2": torch.stack([hf[f"{mod}experts.{e}.{names.down}.weight"] for e in each])}
    if names.shared:
        out[dst + "mlp.shared_expert.linear_fc1.weight"] = torch.cat([hf[mod + "shared_expert.gate_proj.weight"],
                                                                      hf[mod + "shared_expert.up_proj.weight"]])
        out[dst + "mlp.shared_expert.linear_fc2.weight"] = hf[mod + "shared_expert.down_proj.weight"]
        out[dst + "mlp.shared_expert_gate.weight"] = hf[mod + "shared_expert_gate.weight"]
    return out
