"""`model:` section. Key names follow Megatron-LM's arguments."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

from .base import ConfigError, check
from .moe import check_moe, moe_layer_pattern, moe_layer_parameters

# rope_scaling fields by type, named as in a Hugging Face config.json: (required, optional)
ROPE_SCALING = {
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (("factor", "original_max_position_embeddings"),
             ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")),
}


def check_rope_scaling(s: Optional[dict]) -> Optional[dict]:
    """Validate ``model.rope_scaling``; returns it with ``type`` (older Hugging Face configs) named ``rope_type``
    and without ``rope_theta`` (that is ``model.rotary_base``). None / ``default``: no scaling."""
    if s is None:
        return None
    s = {("rope_type" if k == "type" else k): v for k, v in s.items() if k != "rope_theta"}
    kind = s.get("rope_type")
    if kind in (None, "default"):
        if set(s) - {"rope_type"}:
            raise ConfigError(f"model.rope_scaling: fields {sorted(set(s) - {'rope_type'})} need a rope_type "
                              f"(one of {', '.join(ROPE_SCALING)})")
        return None
    if kind not in ROPE_SCALING:
        raise ConfigError(f"model.rope_scaling.rope_type {kind!r} is not supported; valid: "
                          f"{', '.join(ROPE_SCALING)} (or default)")
    required, optional = ROPE_SCALING[kind]
    missing = [k for k in required if s.get(k) is None]
    unknown = sorted(set(s) - {"rope_type", *required, *optional})
    if missing:
        raise ConfigError(f"model.rope_scaling ({kind}) needs {', '.join(missing)}")
    if unknown:
        raise ConfigError(f"model.rope_scaling ({kind}): unknown field {unknown[0]!r}; valid: "
                          f"{', '.join(required + optional)}")
    check(float(s["factor"]) >= 1.0, f"model.rope_scaling.factor ({s['factor']}) must be >= 1")
    return s


@dataclass
class ModelConfig:
    """Llama style by default (RMSNorm, RoPE, SwiGLU, untied head); GPT style with
    ``normalization: LayerNorm, swiglu: false, position_embedding_type: learned_absolute``."""

    num_layers: int = 2
    hidden_size: int = 256
    ffn_hidden_size: Optional[int] = None  # default: 4*h (GeLU) or Llama's 8/3*h rounded to 64 (gated: SwiGLU, GeGLU)
    num_attention_heads: int = 8
    num_query_groups: Optional[int] = None  # kv heads; default = num_attention_heads (MHA)
    kv_channels: Optional[int] = None  # head dim; default hidden_size // num_attention_heads
    # the tokenizer's vocabulary unless set (data.tokenizer_model; NullTokenizer: data.vocab_size + 1), padded to
    # make_vocab_size_divisible_by like Megatron's; set smaller than the tokenizer's: refused; larger: said once.
    # Unset without a tokenizer to follow (mock data, the demo): 32000
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 4096
    rotary_base: float = 10000.0  # RoPE theta; may change between stages of a context extension (ABF)
    # Hugging Face's rope_scaling / rope_parameters mapping: {"rope_type": "linear" | "llama3" | "yarn", ...}
    rope_scaling: Optional[dict] = None
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = True
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    untie_embeddings_and_output_weights: bool = True
    add_bias_linear: bool = False
    init_method_std: float = 0.02
    # Megatron-LM's flag: the residual stream (embedding output, every layer's input and output) in fp32 under bf16
    # autocast. Ours defaults to true (fp32 master weights, fp32 residual); false keeps it in the autocast dtype as
    # Megatron's default, ALST and FPDT do -- half the bytes of every layer input and of the host checkpoints
    # (memory.activation_offload: checkpoints). No effect in fp32 training (CPU).
    fp32_residual_connection: bool = True
    # causal sliding-window attention (Mistral's / Hugging Face's sliding_window, in tokens): query i sees keys
    # (i - W, i] of its document. On the layers layer_types names sliding_attention; every layer when it is unset
    sliding_window: Optional[int] = None
    # per layer, Hugging Face's names: sliding_attention (the window) or full_attention (every earlier key), e.g.
    # Gemma 3's five local layers to one global one. Unset: every layer sliding_attention with a sliding_window
    layer_types: Optional[list[Literal["sliding_attention", "full_attention"]]] = None
    # RoPE theta of the sliding_attention layers, which then take no rope_scaling (Gemma 3's local layers: 10000;
    # the full_attention layers keep rotary_base and rope_scaling). Unset: every layer rotary_base + rope_scaling
    rope_local_base_freq: Optional[float] = None

    # The switches between the Hugging Face families (docs/model_families.md), Megatron-LM's names:
    add_qkv_bias: bool = False  # a bias on the QKV projection only (Qwen2 / 2.5); add_bias_linear: on every linear
    qk_layernorm: bool = False  # RMSNorm over each head's q and k before RoPE, weights [kv_channels] (Qwen3, Gemma 3)
    apply_layernorm_1p: bool = False  # every norm scales by (1 + weight), the weight starting at 0 (Gemma)
    post_self_attn_layernorm: bool = False  # a norm on the attention block's output before the residual (Gemma 2/3)
    post_mlp_layernorm: bool = False  # a norm on the MLP's output before the residual (Gemma 2/3)
    # a gated MLP (fc1 = [gate; up], act(gate) * up): unset = swiglu. swiglu: false with gated_linear_unit: true is
    # GeGLU with tanh GELU (Gemma); swiglu: true is SiLU's gate
    gated_linear_unit: Optional[bool] = None
    scale_embeddings: bool = False  # the embedding's output times sqrt(hidden_size), rounded to its dtype (Gemma)
    softmax_scale: Optional[float] = None  # the attention's query scale; unset: 1/sqrt(kv_channels)
    # the architecture tools/convert_to_hf.py writes (set by the importer; unset: the first family the switches fit)
    hf_architecture: Optional[str] = None
    # the Hugging Face files the model was imported from, as read (set by the importer): {"config": config.json,
    # "generation_config": generation_config.json when it had one}. The export writes them back, every field as
    # imported but those the run changed (hf/configs.export_config: a context extension's RoPE, a longer length)
    hf_import: Optional[dict] = None

    # Mixture of experts (Megatron-LM's names; docs/moe.md). num_moe_experts unset: every MLP dense
    num_moe_experts: Optional[int] = None  # routed experts of an MoE layer (HF: num_experts / num_local_experts)
    moe_router_topk: int = 2  # experts per token (HF: num_experts_per_tok)
    moe_ffn_hidden_size: Optional[int] = None  # one expert's SwiGLU width; unset: ffn_hidden_size
    # false: the top-k weights renormalised to sum to 1 (Qwen3-MoE's norm_topk_prob, Mixtral); true: the softmax
    # over all experts, top-k weights as they are (Qwen2-MoE / Qwen1.5-MoE's norm_topk_prob false)
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0  # Hugging Face's load-balancing loss times this (HF: router_aux_loss_coef)
    moe_z_loss_coeff: Optional[float] = None  # the router z-loss (mean squared logsumexp of the logits) times this
    # which layers are MoE: an integer N -> layers 0, N, 2N, ... (Megatron-LM's 1:N); a list of 0/1 per layer (HF's
    # decoder_sparse_step / mlp_only_layers, e.g. [0, 1, 1, 1])
    moe_layer_freq: Union[int, list[int]] = 1
    moe_shared_expert_intermediate_size: Optional[int] = None  # a dense SwiGLU beside the experts (Qwen2-MoE)
    moe_shared_expert_gate: bool = False  # the shared expert's output times sigmoid(x w) (Qwen2-MoE)

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings"):
            check(getattr(self, name) is None or getattr(self, name) > 0, f"model.{name} ({getattr(self, name)}) must be positive")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is None:
            check(self.hidden_size % self.num_attention_heads == 0,
                  f"model.hidden_size ({self.hidden_size}) must be divisible by model.num_attention_heads "
                  f"({self.num_attention_heads}), or set model.kv_channels")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.gated_linear_unit is None:
            self.gated_linear_unit = self.swiglu
        check(self.gated_linear_unit or not self.swiglu,
              "model.swiglu: true with model.gated_linear_unit: false: SwiGLU is a gated MLP; set swiglu false for a "
              "plain GeLU MLP")
        if self.ffn_hidden_size is None:
            if self.gated_linear_unit:
                self.ffn_hidden_size = 64 * ((int(8 * self.hidden_size / 3) + 63) // 64)
            else:
                self.ffn_hidden_size = 4 * self.hidden_size
        check(self.num_attention_heads % self.num_query_groups == 0,
              f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
              f"model.num_query_groups ({self.num_query_groups})")
        check(self.kv_channels % 2 == 0 or self.position_embedding_type != "rope",
              f"model.kv_channels ({self.kv_channels}) must be even for RoPE")
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        check(self.rope_scaling is None or self.position_embedding_type == "rope",
              "model.rope_scaling needs model.position_embedding_type: rope")
        check(self.sliding_window is None or self.sliding_window >= 1,
              f"model.sliding_window ({self.sliding_window}) must be >= 1 token")
        check(not self.apply_layernorm_1p or self.normalization == "RMSNorm",
              "model.apply_layernorm_1p with model.normalization=LayerNorm: the (1 + weight) norm is Gemma's RMSNorm; "
              "use normalization RMSNorm")
        check(self.softmax_scale is None or self.softmax_scale > 0,
              f"model.softmax_scale ({self.softmax_scale}) must be positive")
        check(self.rope_local_base_freq is None or (self.rope_local_base_freq > 0
                                                    and self.position_embedding_type == "rope"),
              f"model.rope_local_base_freq ({self.rope_local_base_freq}) needs a positive value and "
              f"model.position_embedding_type: rope")
        check(self.hf_import is None or (isinstance(self.hf_import.get("config"), dict)
                                         and set(self.hf_import) <= {"config", "generation_config"}),
              f"model.hf_import holds {sorted(self.hf_import or {})}: it takes config (a config.json's fields) and "
              f"generation_config, as the importer writes them")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.num_layers,
                  f"model.layer_types has {len(self.layer_types)} entries for model.num_layers ({self.num_layers})")
            check(self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                  "model.layer_types names sliding_attention layers but model.sliding_window is not set")
        check_moe(self)

    def moe_layers(self) -> tuple:
        """Which layers are MoE (``moe_layer_freq``; none without ``num_moe_experts``). Example, 4 layers:
        ``moe_layer_freq: 2`` -> ``(True, False, True, False)``; ``[0, 1, 1, 1]`` -> ``(False, True, True, True)``."""
        return moe_layer_pattern(self)

    def attention_windows(self) -> tuple:
        """Each layer's causal window in tokens, None for full attention. Example: 4 layers, ``sliding_window: 1024,
        layer_types: [sliding_attention, sliding_attention, sliding_attention, full_attention]`` -> ``(1024, 1024,
        1024, None)``."""
        types = self.layer_types or ["sliding_attention"] * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in types)

    def layer_ropes(self) -> tuple:
        """Each layer's RoPE as (theta, rope_scaling applies); None without RoPE. ``rope_local_base_freq`` is the
        theta of the layers with a window (none without ``sliding_window``). Example, Gemma 3 with
        ``rotary_base: 1e6, rope_local_base_freq: 10000``, ``layer_types`` five sliding then one full:
        ``((10000.0, False),) * 5 + ((1e6, True),)``."""
        if self.position_embedding_type != "rope":
            return (None,) * self.num_layers
        local = self.rope_local_base_freq
        return tuple((float(local), False) if local is not None and w is not None else (float(self.rotary_base), True)
                     for w in self.attention_windows())

    @property
    def query_scale(self) -> float:
        """What q is multiplied by before the core attention, whose kernels scale by 1/sqrt(kv_channels):
        ``softmax_scale * sqrt(kv_channels)`` (1 unless softmax_scale is set). Gemma 3 27B: head dim 128,
        query_pre_attn_scalar 168 -> softmax_scale 168^-0.5, q times sqrt(128/168)."""
        return 1.0 if self.softmax_scale is None else self.softmax_scale * math.sqrt(self.kv_channels)

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to ``make_vocab_size_divisible_by`` (independent of tp, so every layout
        builds the same full model; the multiple must itself be divisible by tp)."""
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is not known yet: it follows the tokenizer (data.tokenizer_model), "
                              "which is read when the run starts (data.with_tokenizer_vocab); or set it")
        m = self.make_vocab_size_divisible_by
        return m * ((self.vocab_size + m - 1) // m)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count P of the full (unsharded) model, padded vocab included (``active``: of an MoE layer only
        what one token passes through, ``num_active_parameters``)."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.padded_vocab_size
        d, nq, nkv = self.kv_channels, self.num_attention_heads, self.num_query_groups
        norm = h if self.normalization == "RMSNorm" else 2 * h
        attn = h * d * (nq + 2 * nkv) + nq * d * h
        mlp = h * f * (3 if self.gated_linear_unit else 2)
        if self.add_bias_linear or self.add_qkv_bias:
            attn += d * (nq + 2 * nkv)
        if self.add_bias_linear:
            attn += h
            mlp += f * (2 if self.gated_linear_unit else 1) + h
        if self.qk_layernorm:
            attn += 2 * d
        norms = 2 + self.post_self_attn_layernorm + self.post_mlp_layernorm
        layer = attn + norms * norm
        emb = v * h + (self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0)
        head = v * h if self.untie_embeddings_and_output_weights else 0
        mlps = sum(moe_layer_parameters(self, active) if moe else mlp for moe in self.moe_layers())
        return self.num_layers * layer + mlps + emb + head + norm

    def num_active_parameters(self) -> int:
        """Parameters one token passes through: an MoE layer counts its router, its top-k experts and its shared
        expert, not the other experts (the count MFU is relative to, as Megatron-LM and the MoE papers count)."""
        return self.num_parameters(active=True)
