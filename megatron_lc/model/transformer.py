"""The Llama / GPT model, built from parts. No parallel logic and no choice of technique here: ``parts`` (from
``compose/spec.py``) hands out the linears, the embedding and the core attention for the layout, and its
``spec`` names the class of each attention block, MLP and head and the layer executor (plain, recompute, Memo)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..config import ModelConfig
from ..config.documents import DocumentRanges
from ..parallel.tensor_parallel import replicated_parameter, init_std_for_output
from .rope import RotaryEmbedding


class TransformerLayer(nn.Module):
    """``x + post_norm(attn(norm(x)))`` then ``+ post_norm(mlp(norm(.)))``; hidden states ``[s, b, h]``
    (``[s/tp, b, h]`` with SP). The post norms are the spec's (Gemma's, ``model.post_self_attn_layernorm`` /
    ``post_mlp_layernorm``; ``nn.Identity`` otherwise, which returns its input itself)."""

    def __init__(self, cfg: ModelConfig, parts, layer_number: int):
        super().__init__()
        self.layer_number = layer_number
        self.rope_key = parts.rope_key(layer_number)  # which of the model's RoPE tables this layer takes
        out_std = init_std_for_output(cfg.init_method_std, cfg.num_layers)
        sp = parts.sequence_parallel
        spec = parts.spec
        h, eps = cfg.hidden_size, cfg.norm_epsilon
        self.input_layernorm = spec.norm(h, eps, sp)
        self.self_attention = spec.attention_block(cfg, parts, layer_number, out_std)
        self.post_self_attn_layernorm = spec.post_self_attn_norm(h, eps, sp)
        self.pre_mlp_layernorm = spec.norm(h, eps, sp)
        self.mlp = spec.mlp_of(layer_number)(cfg, parts, out_std)  # the MLP, or the MoE on an MoE layer
        self.post_mlp_layernorm = spec.post_mlp_norm(h, eps, sp)

        # How forward runs: None = plain autograd, or the spec's executor ``fn(layer, x, rope) -> y`` (recompute,
        # Memo offload) built from the token-wise parts below. Not an nn.Module: no parameters.
        self.executor = spec.executor() if spec.executor is not None else None

    # The layer in three parts. ``pre_attention`` and ``post_attention`` act token by token (row i of the output
    # depends only on row i of the inputs, up to the tp collectives), only ``core_attention`` mixes tokens.
    def pre_attention(self, x: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [s, b, h]`` -> q, k, v ``[s', b, n, d]`` (s' = s, or tp*s gathered with SP)."""
        return self.self_attention.qkv(self.input_layernorm(x), rope)

    def post_attention(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Layer input ``x`` and core attention output ``[s', b, nq, d]`` -> layer output ``[s, b, h]``."""
        return self.residual(x, self.self_attention.linear_proj(attn_out.flatten(2)))

    def residual(self, x: torch.Tensor, block_out: torch.Tensor) -> torch.Tensor:
        """The layer's two residual steps after its attention block: ``r = x + block_out``, ``r + mlp(norm(r))``.
        ``block_out`` goes before the MLP runs (the sum saves nothing; callers pass it as a temporary): one
        compute-dtype tensor of the layer's rows less at the MLP's forward."""
        r = x + self.post_self_attn_layernorm(block_out)
        del block_out
        return r + self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(r)))

    def plain_forward(self, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        """The layer with plain autograd, whatever the executor (the attention block may be FPDT's)."""
        return self.residual(x, self.self_attention(self.input_layernorm(x), rope, documents))

    def forward(self, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        if self.executor is not None:
            return self.executor(self, x, rope, documents)
        return self.plain_forward(x, rope, documents)


def residual_dtype(fp32_residual: bool, h: torch.Tensor) -> torch.dtype:
    """fp32 with ``model.fp32_residual_connection`` (also when FSDP2 gathers bf16 weights, so the embedding gives
    bf16), else the autocast dtype of ``h``'s device when autocast is on, else ``h``'s own. Every layer's
    ``x + branch`` then stays in it (fp32 + bf16 = fp32; bf16 + bf16 = bf16)."""
    if fp32_residual:
        return torch.float32
    dev = h.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype


class GPTModel(nn.Module):
    """tokens/positions/labels ``[b, s_local]`` -> per-token loss ``[b, s_local]`` (or the local logits shard
    ``[b, s_local, V/tp]`` when labels is None). ``s_local`` is this rank's share of the sequence after context
    parallelism; its tokens may be in any order (zigzag, strided) since positions come with them."""

    def __init__(self, cfg: ModelConfig, parts):
        super().__init__()
        self.cfg, self.topo = cfg, parts.topo
        self.sequence_parallel = parts.sequence_parallel
        self.arena = parts.ctx.arena  # framework buffers; the forward starts one arena iteration
        self.routing = parts.ctx.routing  # the MoE routers' counts: begun and summed over ranks by each forward
        self.embedding = parts.vocab_embedding(cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_method_std)
        self.position_embeddings: Optional[nn.Embedding] = None
        if cfg.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
            replicated_parameter(self.position_embeddings.weight, ("normal", cfg.init_method_std),
                                 parts.sequence_parallel)
        # one RoPE table per distinct (theta, scaled) of the layers (Gemma 3: the local layers' and the global
        # ones'), keyed as ``parts.rope_key`` names them; ``rotary``: the first layer's
        self.rotaries = nn.ModuleDict({parts.rope_key(i): RotaryEmbedding(cfg.kv_channels, rope[0],
                                                                          cfg.rope_scaling if rope[1] else None)
                                       for i, rope in enumerate(parts.layout.ropes) if rope is not None})
        self.rotary = self.rotaries[parts.rope_key(0)] if len(self.rotaries) else None
        self.embedding_scale = math.sqrt(cfg.hidden_size) if cfg.scale_embeddings else None
        self.layers = nn.ModuleList([TransformerLayer(cfg, parts, i) for i in range(cfg.num_layers)])
        self.final_layernorm = parts.spec.norm(cfg.hidden_size, cfg.norm_epsilon, parts.sequence_parallel)
        tied = None if cfg.untie_embeddings_and_output_weights else self.embedding
        self.head = parts.spec.head(cfg, parts, tied)

    def embed(self, tokens_sb: torch.Tensor, pos_sb: torch.Tensor) -> torch.Tensor:
        """The residual stream's first value, in its dtype (``residual_dtype``)."""
        h = self.embedding(tokens_sb)
        if self.embedding_scale is not None:  # Gemma: sqrt(h) rounded to the embedding's dtype, as Hugging Face's
            h = h * torch.full((), self.embedding_scale, dtype=torch.float32, device=h.device).to(h.dtype)
        if self.position_embeddings is not None:
            if self.sequence_parallel:
                pos_sb = pos_sb.chunk(self.topo.tp, dim=0)[self.topo.tp_rank]
            h = h + self.position_embeddings(pos_sb)
        return h.to(residual_dtype(self.cfg.fp32_residual_connection, h))

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                documents: Optional[DocumentRanges] = None) -> torch.Tensor:
        """``documents``: where the packed documents of the *full* sequences start and end (``data.
        reset_attention_mask``; host integers, the same on every rank: each core attention cuts its blocks by the
        global positions of the tokens it holds); None: one causal sequence a row."""
        h = self.final_hidden_states(tokens, position_ids, documents)
        out = self.head(h, labels.t().contiguous() if labels is not None else None)
        return out.transpose(0, 1)

    def final_hidden_states(self, tokens: torch.Tensor, position_ids: torch.Tensor,
                            documents: Optional[DocumentRanges] = None) -> torch.Tensor:
        """What the head reads: ``[s_local, b, h]`` (``[s_local/tp, b, h]`` under sequence parallel) for
        ``tokens [b, s_local]`` -- embedding, the layers (their executors), the final norm."""
        self.arena.begin_iteration()
        self.routing.begin()
        tokens_sb, pos_sb = tokens.t().contiguous(), position_ids.t().contiguous()
        ropes = self.rope_tables(pos_sb)
        h = self.embed(tokens_sb, pos_sb)
        for layer in self.layers:
            h = layer(h, ropes.get(layer.rope_key), documents)
        self.routing.finish(self.topo)  # every router has counted: the load-balancing loss's totals
        return self.final_layernorm(h)

    def rope_tables(self, pos_sb: torch.Tensor) -> dict:
        """``{rope key: (cos, sin)}`` for positions ``[s, b]``, each distinct table once (empty without RoPE)."""
        return {key: rotary(pos_sb) for key, rotary in self.rotaries.items()}
