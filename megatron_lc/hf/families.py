"""The Hugging Face families as data: which ``model:`` switches each one fixes, what its per-layer norms are called,
how it says windows, activation and biases. Nothing here is read by a layer: the importer turns a family into model
keys (``configs.py``), the exporter picks the family whose switches a model has.

    family        architecture        switches (model keys)                                   windows
    Llama         LlamaForCausalLM    --                                                      none
    Mistral       MistralForCausalLM  --                                                      one for every layer
    Qwen2 / 2.5   Qwen2ForCausalLM    add_qkv_bias                                            per layer (layer_types)
    Qwen3         Qwen3ForCausalLM    qk_layernorm                                            per layer (layer_types)
    Gemma 3 text  Gemma3ForCausalLM   qk_layernorm, apply_layernorm_1p, post_self_attn_ and   per layer (local/global,
                                      post_mlp_layernorm, GeGLU, scale_embeddings,            own RoPE theta)
                                      softmax_scale (query_pre_attn_scalar)
    Qwen3-MoE     Qwen3MoeForCausalLM qk_layernorm, num_moe_experts (moe.py)                  one for every layer
    Qwen2-MoE     Qwen2MoeForCausalLM add_qkv_bias, num_moe_experts, a gated shared expert    per layer (layer_types)
    Mixtral       MixtralForCausalLM  num_moe_experts (every layer, top-k renormalised)       one for every layer
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import ConfigError
from .moe import MIXTRAL_EXPERTS, QWEN2_EXPERTS, QWEN_EXPERTS, ExpertNames, moe_mismatches

# what every family's switches are when it does not set them (the Llama model)
PLAIN = {"add_qkv_bias": False, "qk_layernorm": False, "apply_layernorm_1p": False, "post_self_attn_layernorm": False,
         "post_mlp_layernorm": False, "swiglu": True, "gated_linear_unit": True, "scale_embeddings": False}
LLAMA_NORMS = {"input_layernorm": "input_layernorm", "pre_mlp_layernorm": "post_attention_layernorm"}
GEMMA_NORMS = {"input_layernorm": "input_layernorm", "post_self_attn_layernorm": "post_attention_layernorm",
               "pre_mlp_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}
QK_NORMS = {"self_attention.q_layernorm": "self_attn.q_norm", "self_attention.k_layernorm": "self_attn.k_norm"}


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: each family is one object
class Family:
    """One Hugging Face architecture. ``switches``: the model keys it fixes (the others of ``PLAIN`` as there);
    ``norms``: our per-layer norm -> its name; ``windows``: ``none``, ``uniform`` (``sliding_window`` on every
    layer) or ``per_layer`` (``layer_types``); ``activation``: (config field, value); ``bias``: ``llama``
    (``attention_bias`` = ``mlp_bias`` -> ``add_bias_linear``), ``qkv`` (always on q, k, v: ``add_qkv_bias``) or
    ``none`` (``attention_bias`` must be false)."""

    name: str
    architecture: str
    model_type: str
    switches: dict = field(default_factory=dict)
    norms: dict = field(default_factory=lambda: dict(LLAMA_NORMS))
    windows: str = "none"
    activation: tuple = ("hidden_act", "silu")
    bias: str = "none"
    experts: Optional[ExpertNames] = None  # a mixture-of-experts family's MoE MLP (``moe.py``); None: dense

    def model_switches(self) -> dict:
        return {**PLAIN, **self.switches}

    def layer_norms(self, m) -> dict:
        """Our per-layer parameter prefixes -> Hugging Face's, for model section ``m`` (q/k norms when it has them)."""
        return {**self.norms, **(QK_NORMS if m.qk_layernorm else {})}


LLAMA = Family("Llama", "LlamaForCausalLM", "llama", bias="llama")
MISTRAL = Family("Mistral", "MistralForCausalLM", "mistral", windows="uniform")
QWEN2 = Family("Qwen2", "Qwen2ForCausalLM", "qwen2", {"add_qkv_bias": True}, windows="per_layer", bias="qkv")
QWEN3 = Family("Qwen3", "Qwen3ForCausalLM", "qwen3", {"qk_layernorm": True}, windows="per_layer")
GEMMA3 = Family("Gemma3", "Gemma3ForCausalLM", "gemma3_text",
                {"qk_layernorm": True, "apply_layernorm_1p": True, "post_self_attn_layernorm": True,
                 "post_mlp_layernorm": True, "swiglu": False, "gated_linear_unit": True, "scale_embeddings": True},
                norms=GEMMA_NORMS, windows="per_layer", activation=("hidden_activation", "gelu_pytorch_tanh"))
QWEN3_MOE = Family("Qwen3-MoE", "Qwen3MoeForCausalLM", "qwen3_moe", {"qk_layernorm": True}, windows="uniform",
                   experts=QWEN_EXPERTS)
QWEN2_MOE = Family("Qwen2-MoE", "Qwen2MoeForCausalLM", "qwen2_moe", {"add_qkv_bias": True}, windows="per_layer",
                   bias="qkv", experts=QWEN2_EXPERTS)
MIXTRAL = Family("Mixtral", "MixtralForCausalLM", "mixtral", windows="uniform", experts=MIXTRAL_EXPERTS)
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3, QWEN3_MOE, QWEN2_MOE, MIXTRAL)  # the exporter's preference
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}

# Hugging Face fields no family here implements, with the values that mean "off"; any other value is refused
UNSUPPORTED = {"partial_rotary_factor": (1.0, None), "attn_logit_softcapping": (None,),
               "final_logit_softcapping": (None,), "use_bidirectional_attention": (False, None),
               "pretraining_tp": (1, None), "num_experts": (0, None), "num_local_experts": (0, None),
               "quantization_config": (None,), "attention_dropout": (0, 0.0, None), "layer_norm_type": (None,)}


def mismatches(family: Family, m) -> list[str]:
    """What of model section ``m`` ``family`` cannot say (empty: it exports as that family)."""
    out = [f"model.{k}={getattr(m, k)}" for k, v in family.model_switches().items() if getattr(m, k) != v]
    if m.normalization != "RMSNorm":
        out.append(f"model.normalization={m.normalization}")
    if m.position_embedding_type != "rope":
        out.append(f"model.position_embedding_type={m.position_embedding_type}")
    if family.bias != "llama" and m.add_bias_linear:
        out.append("model.add_bias_linear=true")
    windows = [w for w in m.attention_windows() if w is not None]
    if family.windows == "none" and windows:
        out.append(f"model.sliding_window={m.sliding_window}")
    if family.windows == "uniform" and windows and len(windows) != m.num_layers:
        out.append("model.layer_types with full_attention layers")
    if family is not GEMMA3:
        if m.softmax_scale is not None:
            out.append(f"model.softmax_scale={m.softmax_scale}")
        if m.rope_local_base_freq is not None:
            out.append(f"model.rope_local_base_freq={m.rope_local_base_freq}")
    return out + moe_mismatches(family.experts, m)


def export_family(m) -> Family:
    """The family model section ``m`` exports as: ``model.hf_architecture`` if set (checked), else the first of
    ``FAMILIES`` whose switches it has. A model no family fits is one line naming what the nearest refuses.
    Example: ``qk_layernorm: true`` and nothing else of Gemma's -> Qwen3."""
    if m.hf_architecture is not None:
        family = BY_ARCHITECTURE.get(m.hf_architecture)
        if family is None:
            raise ConfigError(f"model.hf_architecture {m.hf_architecture!r} is not one this exporter writes; valid: "
                              f"{', '.join(BY_ARCHITECTURE)}")
        problems = mismatches(family, m)
        if problems:
            raise ConfigError(f"model.hf_architecture {family.architecture} cannot say {', '.join(problems)}")
        return family
    fits = {f: mismatches(f, m) for f in FAMILIES}
    for f, problems in fits.items():
        if not problems:
            return f
    nearest = min(FAMILIES, key=lambda f: len(fits[f]))
    raise ConfigError(f"no Hugging Face family this exporter writes fits the model ({', '.join(BY_ARCHITECTURE)}); "
                      f"the nearest, {nearest.architecture}, cannot say {', '.join(fits[nearest])}")
