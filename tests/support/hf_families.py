"""Random tiny Hugging Face models of every family the importer takes, built here from transformers' config classes
on the CPU (nothing is downloaded), saved with ``save_pretrained``.

Each is 2-3 layers, hidden 64, 4 query heads / 2 kv heads, vocab 256, and has what sets its family apart: Qwen2 a
QKV bias, tied embeddings and RoPE base 1e6; Qwen3 q/k norms and a head dim (32) other than hidden / heads (16);
Mistral a head dim of 32 and a sliding window of 4 tokens on every layer; Gemma 3 two local layers (window 4, RoPE
base 1e4) and a global one (base 1e6, linear RoPE scaling 2), its (1 + w) norms before and after attention and MLP,
GeGLU, the embedding scaled by sqrt(h) and query_pre_attn_scalar 24 (not the head dim). Norm weights are drawn away
from their initial values and biases made non-zero, so a swapped or dropped tensor shows in the logits."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, rms_norm_eps=1e-6)


def family_configs(transformers) -> dict:
    """name -> (config class, its keyword arguments)."""
    return {
        "llama": (transformers.LlamaConfig, dict(COMMON, num_hidden_layers=2,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 5e5})),
        "qwen2": (transformers.Qwen2Config, dict(COMMON, num_hidden_layers=2, tie_word_embeddings=True,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "qwen3": (transformers.Qwen3Config, dict(COMMON, num_hidden_layers=2, head_dim=32,
                                                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "mistral": (transformers.MistralConfig, dict(COMMON, num_hidden_layers=2, head_dim=32, sliding_window=4,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "gemma3": (transformers.Gemma3TextConfig, dict(
            COMMON, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24, sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    }


ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}
FAMILIES = tuple(ARCHITECTURES)


def hf_model(name: str, seed: int = 0, **changes):
    """The random tiny transformers model of family ``name`` (fp32, eager attention), config ``changes`` applied."""
    import transformers

    cls, kwargs = {**family_configs(transformers), **moe_family_configs(transformers)}[name]
    cfg = cls(**{**kwargs, **changes})
    cfg.architectures = [ARCHITECTURES[name]]
    torch.manual_seed(seed)
    model = getattr(transformers, ARCHITECTURES[name])(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # away from 1 (and from 0 for Gemma's zero-centred weights)
                p.uniform_(0.5, 1.5) if name != "gemma3" else p.uniform_(-0.5, 0.5)
            elif n.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif n.endswith("gate.weight"):  # an MoE router (and Qwen2-MoE's shared-expert gate): decisive picks
                p.normal_(0.0, 0.5)
    model.config._attn_implementation = "eager"
    return model.eval()


def save_hf_model(name: str, path, seed: int = 0, **changes):
    """``hf_model`` saved at ``path`` (safetensors); returns the model."""
    model = hf_model(name, seed, **changes)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


# the mixture-of-experts families: 4 experts (8 for Qwen3-MoE), top-2, each expert 32 wide. Qwen3-MoE with
# norm_topk_prob (the top-k renormalised) and a head dim of 32; Qwen2-MoE without it (pre-softmax weights), its
# gated shared expert (48 wide) and layer 0 dense (mlp_only_layers); Mixtral renormalises always
MOE_COMMON = dict(COMMON, num_hidden_layers=2, num_experts_per_tok=2, router_aux_loss_coef=0.02)


def moe_family_configs(transformers) -> dict:
    return {
        "qwen3_moe": (transformers.Qwen3MoeConfig, dict(MOE_COMMON, head_dim=32, num_experts=8,
                                                        moe_intermediate_size=32, norm_topk_prob=True,
                                                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        "qwen2_moe": (transformers.Qwen2MoeConfig, dict(MOE_COMMON, num_experts=4, moe_intermediate_size=32,
                                                        shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                        mlp_only_layers=[0])),
        "mixtral": (transformers.MixtralConfig, dict(MOE_COMMON, num_local_experts=4, intermediate_size=32,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    }


ARCHITECTURES.update(qwen3_moe="Qwen3MoeForCausalLM", qwen2_moe="Qwen2MoeForCausalLM", mixtral="MixtralForCausalLM")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
