"""Hugging Face tensors <-> the framework's full state dict, for every family (``families.py``).

Our fused QKV weight (and bias) is grouped by kv head, ``[g: q_0..q_{r-1}, k, v]`` for each of the ``nkv`` groups
(r = heads per kv head), so a contiguous tp slice holds whole groups; Hugging Face has ``q_proj`` (query head
``g*r + j``), ``k_proj``, ``v_proj``. Our gated ``fc1`` is ``[gate; up]``; Hugging Face has ``gate_proj`` and
``up_proj``. RoPE needs no permutation (both rotate halves). The per-layer norms are named by the family
(``Family.layer_norms``: Gemma's four, the q/k norms); Gemma's zero-centred norm weights are stored as they are
(our ``ZeroCenteredRMSNorm`` scales by 1 + weight too). Tied embeddings: no ``lm_head.weight`` in Hugging Face, no
``head.output_layer`` here."""
from __future__ import annotations

import torch

from .families import Family
from .moe import experts_from_hf, experts_to_hf


def _biases(m) -> tuple[tuple, tuple]:
    """(the kinds of the QKV projection's tensors, those of the other linears): weight, and bias where the model
    has one."""
    qkv = ("weight", "bias") if (m.add_bias_linear or m.add_qkv_bias) else ("weight",)
    return qkv, (("weight", "bias") if m.add_bias_linear else ("weight",))


def to_hf(state: dict, m, family: Family, keep_padded_vocab: bool = False) -> dict:
    """Full framework state dict -> the family's Hugging Face tensor names."""
    d, nq, nkv, f = m.kv_channels, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size
    r = nq // nkv
    vocab = m.padded_vocab_size if keep_padded_vocab else m.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.weight"][:vocab],
           "model.norm.weight": state["final_layernorm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["head.output_layer.weight"][:vocab]
    qkv_kinds, kinds = _biases(m)
    moe = m.moe_layers()
    for i in range(m.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        if moe[i]:  # the MoE MLP's router and experts (``moe.py``)
            out.update(experts_to_hf(state, m, family.experts, src, dst))
        for ours, theirs in family.layer_norms(m).items():
            out[dst + theirs + ".weight"] = state[src + ours + ".weight"]
        for kind in qkv_kinds:
            qkv = state[src + f"self_attention.linear_qkv.{kind}"]
            grouped = qkv.view(nkv, r + 2, d, *qkv.shape[1:])  # [g: q_0..q_{r-1}, k, v]
            out[dst + f"self_attn.q_proj.{kind}"] = grouped[:, :r].reshape(nq * d, *qkv.shape[1:])
            out[dst + f"self_attn.k_proj.{kind}"] = grouped[:, r].reshape(nkv * d, *qkv.shape[1:])
            out[dst + f"self_attn.v_proj.{kind}"] = grouped[:, r + 1].reshape(nkv * d, *qkv.shape[1:])
        for kind in kinds:
            out[dst + f"self_attn.o_proj.{kind}"] = state[src + f"self_attention.linear_proj.{kind}"]
            if moe[i]:
                continue
            fc1 = state[src + f"mlp.linear_fc1.{kind}"]  # [gate; up]
            out[dst + f"mlp.gate_proj.{kind}"], out[dst + f"mlp.up_proj.{kind}"] = fc1[:f], fc1[f:]
            out[dst + f"mlp.down_proj.{kind}"] = state[src + f"mlp.linear_fc2.{kind}"]
    return out


def from_hf(hf: dict, m, family: Family) -> dict:
    """The family's Hugging Face tensors -> full framework state dict (the inverse of ``to_hf``; vocabulary rows
    padded with zeros up to ``padded_vocab_size`` when it is larger)."""
    d, nq, nkv = m.kv_channels, m.num_attention_heads, m.num_query_groups
    r = nq // nkv

    def pad(t):
        extra = m.padded_vocab_size - t.shape[0]
        return torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) if extra > 0 else t

    out = {"embedding.weight": pad(hf["model.embed_tokens.weight"]), "final_layernorm.weight": hf["model.norm.weight"]}
    if m.untie_embeddings_and_output_weights:
        out["head.output_layer.weight"] = pad(hf["lm_head.weight"])
    qkv_kinds, kinds = _biases(m)
    moe = m.moe_layers()
    for i in range(m.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        if moe[i]:
            out.update(experts_from_hf(hf, m, family.experts, src, dst))
        for ours, theirs in family.layer_norms(m).items():
            out[dst + ours + ".weight"] = hf[src + theirs + ".weight"]
        for kind in qkv_kinds:
            q, k, v = (hf[src + f"self_attn.{n}_proj.{kind}"] for n in "qkv")
            rest = q.shape[1:]
            grouped = torch.cat([q.reshape(nkv, r, d, *rest), k.reshape(nkv, 1, d, *rest), v.reshape(nkv, 1, d, *rest)],
                                dim=1)  # [g: q_0..q_{r-1}, k, v]
            out[dst + f"self_attention.linear_qkv.{kind}"] = grouped.reshape(-1, *rest)
        for kind in kinds:
            out[dst + f"self_attention.linear_proj.{kind}"] = hf[src + f"self_attn.o_proj.{kind}"]
            if moe[i]:
                continue
            out[dst + f"mlp.linear_fc1.{kind}"] = torch.cat([hf[src + f"mlp.gate_proj.{kind}"],
                                                             hf[src + f"mlp.up_proj.{kind}"]])
            out[dst + f"mlp.linear_fc2.{kind}"] = hf[src + f"mlp.down_proj.{kind}"]
    return out
