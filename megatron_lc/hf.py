"""Hugging Face Llama <-> megatron_lc: configs, tensor names and layouts, both ways (``tools/convert_from_hf.py``,
``tools/convert_to_hf.py``).

Layouts: our fused QKV weight is grouped by kv head, ``[g: q_0..q_{r-1}, k, v]`` for each of the ``nkv`` groups
(r = heads per kv head), so a contiguous tp slice holds whole groups; HF has ``q_proj`` (query head ``g*r + j``),
``k_proj``, ``v_proj``. Our SwiGLU ``fc1`` is ``[gate; up]``; HF has ``gate_proj`` and ``up_proj``. RoPE needs no
permutation (both rotate halves). Tied embeddings: no ``lm_head.weight`` in HF, no ``head.output_layer`` here.

Import covers the Llama family (Llama-2, 3, 3.1, 3.2: ``LlamaForCausalLM``, GQA, tied or untied embeddings,
``head_dim``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling`` / ``rope_parameters`` of the types in
``config/model.py``); any other architecture or field value is one line naming it.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional

import torch
import yaml
from safetensors.torch import load_file

from .config import Config, ConfigError, resolve_layout
from .config.model import ROPE_SCALING, check_rope_scaling
from .training.checkpointing.load import write_model_checkpoint
from .training.checkpointing.reshard import parameter_shapes

HF_TO_MODEL = {  # HF config.json field -> model section key (the rest is derived or checked below)
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "ffn_hidden_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_query_groups", "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "norm_epsilon", "initializer_range": "init_method_std",
}


# ---- configs -------------------------------------------------------------------------------------------------------
def _rope(hf: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = params or hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default", *ROPE_SCALING):
        raise ConfigError(f"rope_scaling type {scaling.get('rope_type', scaling.get('type'))!r} is not supported "
                          f"(supported: {', '.join(ROPE_SCALING)})")
    return float(theta), check_rope_scaling(scaling)


def model_section_from_hf(hf: dict) -> dict:
    """The ``model:`` section of a Hugging Face Llama ``config.json`` (one-line ConfigError naming what does not
    fit). The vocabulary is not padded (``make_vocab_size_divisible_by`` divides it), so logits and loss match."""
    arch = hf.get("architectures") or ["?"]
    problems = []
    if hf.get("model_type") != "llama" or arch[0] != "LlamaForCausalLM":
        problems.append(f"architecture {arch[0]} (model_type {hf.get('model_type')!r}; only LlamaForCausalLM)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (only silu)")
    if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
        problems.append("attention_bias != mlp_bias (one add_bias_linear here)")
    if hf.get("pretraining_tp", 1) != 1:
        problems.append(f"pretraining_tp={hf['pretraining_tp']}")
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        problems.append(f"partial_rotary_factor={hf['partial_rotary_factor']}")
    if problems:
        raise ConfigError(f"cannot import this Hugging Face model: {'; '.join(problems)}")
    model = {ours: hf[theirs] for theirs, ours in HF_TO_MODEL.items() if theirs in hf}
    theta, scaling = _rope(hf)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    model.update(kv_channels=head_dim, rotary_base=theta, rope_scaling=scaling, normalization="RMSNorm",
                 swiglu=True, position_embedding_type="rope", add_bias_linear=bool(hf.get("attention_bias", False)),
                 untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
                 make_vocab_size_divisible_by=math.gcd(hf["vocab_size"], 128))
    return model


def check_exportable(m) -> None:
    problems = []
    if m.normalization != "RMSNorm":
        problems.append(f"model.normalization={m.normalization}")
    if not m.swiglu:
        problems.append("model.swiglu=false")
    if m.position_embedding_type != "rope":
        problems.append(f"model.position_embedding_type={m.position_embedding_type}")
    if problems:
        raise ConfigError(f"only Llama-style models (RMSNorm, SwiGLU, RoPE) export to LlamaForCausalLM; this "
                          f"checkpoint has {', '.join(problems)}")


def hf_config(m, dtype: str, keep_padded_vocab: bool, bos: int | None, eos: int | None,
              trained_length: int = 0) -> dict:
    """The ``config.json`` of model section ``m``; ``max_position_embeddings`` is at least ``trained_length`` (the
    sequence length the checkpoint was trained at, which may exceed the declared value under RoPE)."""
    scaling = dict(m.rope_scaling or {"rope_type": "default"})
    rope = {**scaling, "rope_theta": m.rotary_base}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.padded_vocab_size if keep_padded_vocab else m.vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": m.ffn_hidden_size, "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads, "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels, "hidden_act": "silu",
        "max_position_embeddings": max(m.max_position_embeddings, trained_length),
        "rms_norm_eps": m.norm_epsilon,
        # transformers < 5 reads rope_theta and rope_scaling, >= 5 rope_parameters
        "rope_theta": m.rotary_base, "rope_scaling": m.rope_scaling, "rope_parameters": rope,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": m.add_bias_linear, "mlp_bias": m.add_bias_linear, "attention_dropout": 0.0,
        "initializer_range": m.init_method_std, "bos_token_id": bos, "eos_token_id": eos, "use_cache": True,
        "torch_dtype": dtype, "dtype": dtype,
    }


# ---- tensors -------------------------------------------------------------------------------------------------------
def to_hf(state: dict, m, keep_padded_vocab: bool = False) -> dict:
    """Full framework state dict -> HF Llama tensor names."""
    d, nq, nkv, f = m.kv_channels, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    r = nq // nkv
    vocab = m.padded_vocab_size if keep_padded_vocab else m.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.weight"][:vocab],
           "model.norm.weight": state["final_layernorm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["head.output_layer.weight"][:vocab]
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = state[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = state[src + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            qkv = state[src + f"self_attention.linear_qkv.{kind}"]
            grouped = qkv.view(nkv, r + 2, d, *qkv.shape[1:])  # [g: q_0..q_{r-1}, k, v]
            out[dst + f"self_attn.q_proj.{kind}"] = grouped[:, :r].reshape(nq * d, *qkv.shape[1:])
            out[dst + f"self_attn.k_proj.{kind}"] = grouped[:, r].reshape(nkv * d, *qkv.shape[1:])
            out[dst + f"self_attn.v_proj.{kind}"] = grouped[:, r + 1].reshape(nkv * d, *qkv.shape[1:])
            out[dst + f"self_attn.o_proj.{kind}"] = state[src + f"self_attention.linear_proj.{kind}"]
            fc1 = state[src + f"mlp.linear_fc1.{kind}"]  # [gate; up]
            out[dst + f"mlp.gate_proj.{kind}"], out[dst + f"mlp.up_proj.{kind}"] = fc1[:f], fc1[f:]
            out[dst + f"mlp.down_proj.{kind}"] = state[src + f"mlp.linear_fc2.{kind}"]
    return out


def from_hf(hf: dict, m) -> dict:
    """HF Llama tensors -> full framework state dict (the inverse of ``to_hf``; vocabulary rows padded with zeros
    up to ``padded_vocab_size`` when it is larger)."""
    d, nq, nkv = m.kv_channels, m.num_attention_heads, m.num_query_groups
    r = nq // nkv

    def pad(t):
        extra = m.padded_vocab_size - t.shape[0]
        return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra > 0 else t

    out = {"embedding.weight": pad(hf["model.embed_tokens.weight"]), "final_layernorm.weight": hf["model.norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["head.output_layer.weight"] = pad(hf["lm_head.weight"])
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias") if m.add_bias_linear else ("weight",):
            q, k, v = (hf[src + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            rest = q.shape[1:]
            grouped = torch.cat([q.reshape(nkv, r, d, *rest), k.reshape(nkv, 1, d, *rest), v.reshape(nkv, 1, d, *rest)],
                                dim=1)  # [g: q_0..q_{r-1}, k, v]
            out[dst + f"self_attention.linear_qkv.{kind}"] = grouped.reshape(-1, *rest)
            out[dst + f"self_attention.linear_proj.{kind}"] = hf[src + f"self_attn.o_proj.{kind}"]
            out[dst + f"mlp.linear_fc1.{kind}"] = torch.cat([hf[src + f"mlp.gate_proj.{kind}"],
                                                             hf[src + f"mlp.up_proj.{kind}"]])
            out[dst + f"mlp.linear_fc2.{kind}"] = hf[src + f"mlp.down_proj.{kind}"]
    return out


def read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """(``config.json``, all tensors) of a Hugging Face model directory: ``model.safetensors``, or the shards of
    ``model.safetensors.index.json``."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"{hf_dir} is not a Hugging Face model directory (no config.json)")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        with open(index) as f:
            files = [os.path.join(hf_dir, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise ConfigError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json (PyTorch .bin weights: "
                          f"save them as safetensors first)")
    tensors = {}
    for path in files:
        if not os.path.isfile(path):
            raise ConfigError(f"{path} is listed in the safetensors index but missing")
        tensors.update(load_file(path))
    return hf_cfg, tensors


IGNORED = ("rotary_emb.inv_freq",)  # buffers some older exports carry


def import_hf(hf_dir: str, out: str, tp: int = 1) -> str:
    """Write ``out/iter_0000000`` (a megatron_lc checkpoint of the model's weights; it loads at any tp, cp and dp,
    its optimizer starts afresh; ``tp``: the tensor-parallel degree it is meant for, checked to divide the model)
    and ``out/model.yaml`` (the matching ``model:`` section) for the Hugging Face Llama directory ``hf_dir``.
    Returns the checkpoint directory. Weights are kept in fp32."""
    hf_cfg, tensors = read_hf_dir(hf_dir)
    cfg = Config.from_dict({"model": model_section_from_hf(hf_cfg),
                            "parallel": {"tensor_model_parallel_size": tp}})
    resolve_layout(cfg, tp)  # heads / kv heads / ffn / vocab divisible by tp: one line if not
    tensors = {k: v for k, v in tensors.items() if not k.endswith(IGNORED)}
    m = cfg.model
    if not m.untie_embeddings_and_output_weights:
        tensors.pop("lm_head.weight", None)  # tied: HF may store the same tensor twice
    try:
        full = {k: v.float() for k, v in from_hf(tensors, m).items()}
    except KeyError as e:
        raise ConfigError(f"{hf_dir}: tensor {e.args[0]} missing for a {m.num_layers}-layer Llama") from None
    used = set(to_hf(full, m))
    extra = sorted(set(tensors) - used)
    if extra:
        raise ConfigError(f"{hf_dir}: tensors this Llama import does not know: {extra[:5]}")
    missing = sorted(set(parameter_shapes(cfg)) - set(full))
    if missing:
        raise ConfigError(f"{hf_dir}: no tensor for {missing[:5]}")
    path = write_model_checkpoint(out, cfg, full, {"imported_from": os.path.abspath(hf_dir)})
    with open(os.path.join(out, "model.yaml"), "w") as f:
        f.write(f"# the model section of {hf_dir}, imported by megatron_lc (tools/convert_from_hf.py)\n")
        yaml.safe_dump({"model": cfg.to_dict()["model"]}, f, sort_keys=False)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "chat_template.jinja", "chat_template.json"):  # a chat model's template: kept for fine-tuning
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(out, name))
    return path
