"""Hugging Face ``config.json`` <-> the ``model:`` section, for every family of ``families.py``.

Import: the family by ``architectures[0]``; its switches; the windows (``sliding_window`` on every layer, or per
layer by ``layer_types``, from ``use_sliding_window`` / ``max_window_layers`` or ``sliding_window_pattern`` in older
configs); RoPE (``rope_parameters``, per layer type for Gemma 3: the local layers' theta is
``model.rope_local_base_freq``; or ``rope_theta`` + ``rope_scaling``); Gemma 3's ``query_pre_attn_scalar`` as
``model.softmax_scale``. Any field we do not implement, or a value of one we do not support, is one line naming it.
Export writes the family's config from the model keys (``families.export_family`` picks the family); for an imported
model, the config.json it was imported from, every field as it was but those the run changed (``export_config``)."""
from __future__ import annotations

import math
from typing import Optional

from ..config import ConfigError
from ..config.model import ROPE_SCALING, ModelConfig, check_rope_scaling
from .families import BY_ARCHITECTURE, GEMMA3, UNSUPPORTED, Family, export_family
from .moe import MOE_FIELDS, QWEN_EXPERTS, moe_hf_fields, moe_section_from_hf

HF_TO_MODEL = {  # HF config.json field -> model section key (the rest is derived or checked below)
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups", "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "norm_epsilon", "initializer_range": "init_method_std",
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def _rope(params: dict, hf: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) of one ``rope_parameters`` mapping, or of ``rope_theta`` + ``rope_scaling``."""
    params = dict(params or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params or hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", *ROPE_SCALING):
        raise ConfigError(f"rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                          f"(supported: {', '.join(ROPE_SCALING)})")
    return float(theta), check_rope_scaling(scaling)


def _layer_types(hf: dict, family: Family) -> Optional[list]:
    """Each layer's type, or None when the config says none (every layer the same)."""
    n = hf["num_hidden_layers"]
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    if family.windows == "per_layer" and family is not GEMMA3:  # Qwen: the layers from max_window_layers on
        if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
            return None
        first = hf.get("max_window_layers", n)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern"))
    if family is GEMMA3 and pattern:  # every pattern-th layer global
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return None


def _windows(hf: dict, family: Family, problems: list) -> dict:
    """``sliding_window`` and ``layer_types`` keys: None / None when no layer has a window."""
    window = hf.get("sliding_window")
    if family.windows == "none" or window is None:
        return {"sliding_window": None, "layer_types": None}
    if family.windows == "uniform":  # (Qwen3-MoE says whether with use_sliding_window)
        return {"sliding_window": int(window) if hf.get("use_sliding_window", True) else None, "layer_types": None}
    if family is not GEMMA3 and "use_sliding_window" in hf and not hf["use_sliding_window"] and \
            not hf.get("layer_types"):
        return {"sliding_window": None, "layer_types": None}
    types = _layer_types(hf, family)
    if types is None:
        return {"sliding_window": int(window), "layer_types": None}
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        problems.append(f"layer_types {unknown} (supported: {', '.join(LAYER_TYPES)})")
        return {}
    if "sliding_attention" not in types:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": int(window), "layer_types": types}


def _ropes(hf: dict, problems: list) -> dict:
    """``rotary_base``, ``rope_scaling``, ``rope_local_base_freq``: per layer type when ``rope_parameters`` is keyed
    by layer type (Gemma 3 in transformers >= 5), or ``rope_local_base_freq`` (earlier Gemma 3 configs)."""
    params = hf.get("rope_parameters") or {}
    if set(params) and set(params) <= set(LAYER_TYPES):
        theta, scaling = _rope(params.get("full_attention"), hf)
        local = params.get("sliding_attention")
        if local is None:
            return {"rotary_base": theta, "rope_scaling": scaling, "rope_local_base_freq": None}
        local_theta, local_scaling = _rope(local, hf)
        if local_scaling is not None:
            problems.append(f"rope_parameters.sliding_attention of type {local_scaling['rope_type']} (the local "
                            f"layers take a plain RoPE theta only)")
        same = local_theta == theta and scaling is None
        return {"rotary_base": theta, "rope_scaling": scaling, "rope_local_base_freq": None if same else local_theta}
    theta, scaling = _rope(params, hf)
    local = hf.get("rope_local_base_freq")
    return {"rotary_base": theta, "rope_scaling": scaling,
            "rope_local_base_freq": None if local is None or (local == theta and scaling is None) else float(local)}


def model_section_from_hf(hf: dict) -> dict:
    """The ``model:`` section of a Hugging Face ``config.json`` of any family of ``families.FAMILIES`` (one-line
    ConfigError naming what does not fit). The vocabulary is not padded (``make_vocab_size_divisible_by`` divides
    it), so logits and loss match."""
    arch = (hf.get("architectures") or ["?"])[0]
    family = BY_ARCHITECTURE.get(arch)
    if family is None or hf.get("model_type") != family.model_type:
        raise ConfigError(f"cannot import this Hugging Face model: architecture {arch} (model_type "
                          f"{hf.get('model_type')!r}; supported: {', '.join(BY_ARCHITECTURE)})")
    problems = [f"{k}={hf[k]!r} (not implemented)" for k, off in UNSUPPORTED.items() if k in hf and hf[k] not in off
                and not (family.experts and k in MOE_FIELDS)]
    field_name, value = family.activation
    if hf.get(field_name, value) != value:
        problems.append(f"{field_name}={hf[field_name]!r} (only {value})")
    bias = {"add_bias_linear": False}
    if family.bias == "llama":
        if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
            problems.append("attention_bias != mlp_bias (one add_bias_linear here)")
        bias["add_bias_linear"] = bool(hf.get("attention_bias", False))
    elif hf.get("attention_bias"):
        problems.append("attention_bias=True (a bias on o_proj without one on the MLP)")
    if hf.get("mlp_bias") and family.bias != "llama":
        problems.append("mlp_bias=True")
    windows = _windows(hf, family, problems)
    ropes = _ropes(hf, problems)
    moe = moe_section_from_hf(hf, family.experts, problems) if family.experts else {}
    if problems:
        raise ConfigError(f"cannot import this Hugging Face model: {'; '.join(problems)}")
    model = {ours: hf[theirs] for theirs, ours in HF_TO_MODEL.items() if theirs in hf}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    scalar = hf.get("query_pre_attn_scalar") if family is GEMMA3 else None
    model.update(kv_channels=head_dim, **ropes, normalization="RMSNorm", position_embedding_type="rope", **bias,
                 **family.model_switches(), **windows,
                 softmax_scale=None if scalar is None or scalar == head_dim else float(scalar) ** -0.5,
                 untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", family is GEMMA3),
                 make_vocab_size_divisible_by=math.gcd(hf["vocab_size"], 128), hf_architecture=family.architecture,
                 **moe)
    return model


def _query_pre_attn_scalar(m) -> float:
    """Gemma 3's ``query_pre_attn_scalar`` of ``model.softmax_scale`` (an integer when it rounds to one)."""
    if m.softmax_scale is None:
        return m.kv_channels
    q = m.softmax_scale ** -2
    return int(round(q)) if abs(q - round(q)) < 1e-6 * q else q


def _family_fields(family: Family, m) -> dict:
    """The fields that differ between the families."""
    windows = m.attention_windows()
    types = ["sliding_attention" if w is not None else "full_attention" for w in windows]
    sliding = any(w is not None for w in windows)
    out = {family.activation[0]: family.activation[1]}
    if family.bias == "llama":
        out.update(attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear)
    elif family.bias == "none":
        out["attention_bias"] = False
    if family.windows == "uniform":
        out["sliding_window"] = m.sliding_window if sliding else None
    elif family.windows == "per_layer":
        out.update(sliding_window=m.sliding_window if sliding else None, layer_types=types)
        if family is not GEMMA3:
            out.update(use_sliding_window=sliding,
                       max_window_layers=types.index("sliding_attention") if sliding else m.num_layers)
    if family is GEMMA3:
        full = {**(m.rope_scaling or {"rope_type": "default"}), "rope_theta": m.rotary_base}
        local = ({"rope_type": "default", "rope_theta": m.rope_local_base_freq}
                 if m.rope_local_base_freq is not None else full)
        out.update(query_pre_attn_scalar=_query_pre_attn_scalar(m), final_logit_softcapping=None,
                   attn_logit_softcapping=None, use_bidirectional_attention=False,
                   rope_parameters={"full_attention": full, "sliding_attention": local},
                   rope_local_base_freq=local["rope_theta"])
    if family.experts:
        out.update(moe_hf_fields(family.experts, m))
        if family.experts is QWEN_EXPERTS:  # Qwen3-MoE drops sliding_window unless use_sliding_window
            out["use_sliding_window"] = any(w is not None for w in windows)
    return out


def hf_config(m, dtype: str, keep_padded_vocab: bool, bos: int | None, eos: int | None,
              trained_length: int = 0) -> dict:
    """The ``config.json`` of model section ``m`` for its family (``families.export_family``);
    ``max_position_embeddings`` is at least ``trained_length`` (the sequence length the checkpoint was trained at,
    which may exceed the declared value under RoPE)."""
    family = export_family(m)
    rope = {**(m.rope_scaling or {"rope_type": "default"}), "rope_theta": m.rotary_base}
    return {
        "architectures": [family.architecture], "model_type": family.model_type,
        "vocab_size": m.padded_vocab_size if keep_padded_vocab else m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels, "max_position_embeddings": max(m.max_position_embeddings, trained_length),
        "rms_norm_eps": m.norm_epsilon,
        # transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters
        "rope_theta": m.rotary_base, "rope_scaling": m.rope_scaling, "rope_parameters": rope,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights, "attention_dropout": 0.0,
        "initializer_range": m.init_method_std, "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype, **_family_fields(family, m),
    }


DTYPE_FIELDS = ("torch_dtype", "dtype")  # transformers < 5 reads the first, >= 5 the second


def export_config(m, dtype: str, keep_padded_vocab: bool, bos: int | None, eos: int | None,
                  trained_length: int = 0) -> dict:
    """The export's ``config.json``: ``hf_config``'s for a model made here; for an imported one (``model.hf_import``)
    the config.json it was imported from, field for field, but for what the run changed: a field ``hf_config``
    gives differently for this model than for the model the import made is written anew (a context extension's
    ``rope_theta`` / ``rope_parameters``, ``max_position_embeddings`` raised by training at a longer length, the
    padded vocabulary with ``--keep-padded-vocab``), and the weights' dtype goes under the dtype fields the import
    had. Example: a Qwen3 import fine-tuned below its ``max_position_embeddings`` -> its config.json as it was
    (``max_window_layers``, ``transformers_version``, a list of eos ids, the one dtype field it had), nothing added,
    nothing dropped."""
    now = hf_config(m, dtype, keep_padded_vocab, bos, eos, trained_length)
    imported = (m.hf_import or {}).get("config")
    if imported is None:
        return now
    then = hf_config(ModelConfig(**model_section_from_hf(imported)), dtype, False, bos, eos)
    out = dict(imported)
    out.update({k: v for k, v in now.items() if k not in DTYPE_FIELDS and v != then.get(k)})
    out.update({k: dtype for k in [k for k in DTYPE_FIELDS if k in imported] or DTYPE_FIELDS})
    return out
