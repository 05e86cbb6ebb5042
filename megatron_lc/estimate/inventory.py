"""What one rank holds: its parameter shards and the activation tensors of one micro-batch, read off the code, for
the sizes of ``dims.Dims``.

Per-layer *skeletal* tensors (kept from a layer's forward to its backward; Memo §3.1) are listed by
``layer_skeletal`` with the tensor that holds them in ``model/`` and Memo's group (``input`` / ``attn`` /
``others``, §4.1). Dtypes: on CPU everything is fp32; on GPU with ``train.bf16`` the linears, attention and MLP
produce bf16 (``compute_bytes``), while the residual stream stays fp32 (``residual_bytes``: fp32 embedding + bf16
branch = fp32 under autocast; bf16 with ``model.fp32_residual_connection: false``) and lse/softmax/statistics are
fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..config import Config
from ..memory.mst.rules import head_chunk_count, head_chunk_tokens, mlp_chunk_tokens
from . import moe
from .dims import Dims

Group = Literal["input", "attn", "others"]


@dataclass(frozen=True)
class Item:
    """One tensor of a rank: ``name`` (where it lives in the code), ``bytes``, Memo group."""

    name: str
    bytes: float
    group: Group = "others"


# ---- parameters -----------------------------------------------------------------------------------------------
def param_shards(dims: Dims) -> list[tuple[str, int, bool]]:
    """(name, local numel, weight-decay group?) in ``model.named_parameters()`` order; decay = ndim >= 2, not bias."""
    h, d = dims.hidden, dims.head_dim
    out: list[tuple[str, int, bool]] = [("embedding.weight", dims.vocab_local * h, True)]
    if dims.learned_positions:
        out.append(("position_embeddings.weight", dims.learned_positions * h, True))
    norm = [("weight", h, False)] + ([] if dims.rmsnorm else [("bias", h, False)])
    fc1_out = (2 if dims.swiglu else 1) * dims.ffn_local
    qkv_heads = dims.heads_local + 2 * dims.kv_heads_local
    for i in range(dims.num_layers):
        pre = f"layers.{i}."
        out += [(pre + "input_layernorm." + n, k, g) for n, k, g in norm]
        out.append((pre + "self_attention.linear_qkv.weight", qkv_heads * d * h, True))
        if dims.linear_bias or dims.qkv_bias:
            out.append((pre + "self_attention.linear_qkv.bias", qkv_heads * d, False))
        out.append((pre + "self_attention.linear_proj.weight", h * dims.heads_local * d, True))
        if dims.linear_bias:
            out.append((pre + "self_attention.linear_proj.bias", h, False))
        if dims.qk_norm:  # one weight [d] each, shared by the heads, whole on every tp rank
            out += [(pre + f"self_attention.{x}_layernorm.weight", d, False) for x in "qk"]
        if dims.post_attn_norm:
            out += [(pre + "post_self_attn_layernorm." + n, k, g) for n, k, g in norm]
        out += [(pre + "pre_mlp_layernorm." + n, k, g) for n, k, g in norm]
        if dims.moe_layers and dims.moe_layers[i]:  # the router, this expert rank's experts (estimate/moe.py)
            out += moe.layer_params(dims, pre)
        else:
            out.append((pre + "mlp.linear_fc1.weight", fc1_out * h, True))
            if dims.linear_bias:
                out.append((pre + "mlp.linear_fc1.bias", fc1_out, False))
            out.append((pre + "mlp.linear_fc2.weight", h * dims.ffn_local, True))
            if dims.linear_bias:
                out.append((pre + "mlp.linear_fc2.bias", h, False))
        if dims.post_mlp_norm:
            out += [(pre + "post_mlp_layernorm." + n, k, g) for n, k, g in norm]
    out += [("final_layernorm." + n, k, g) for n, k, g in norm]
    if dims.untied_head:
        out.append(("head.output_layer.weight", dims.vocab_local * h, True))
    return out


def zero1_partition(shards: list[tuple[str, int, bool]], ranks: int) -> list[int]:
    """Elements per rank of torch's ``ZeroRedundancyOptimizer`` partition (what ``training/optimizer.py`` builds):
    the decay group then the no-decay group, each sorted largest first (stable), each parameter to the rank with the
    fewest elements so far (first such rank)."""
    sizes = [0] * ranks
    for group in (True, False):
        for _, n, _g in sorted([s for s in shards if s[2] == group], key=lambda s: s[1], reverse=True):
            r = sizes.index(min(sizes))
            sizes[r] += n
    return sizes


# ---- MsT chunking (memory/mst/rules.py, the modules' own rules) ------------------------------------------------
def mst_mlp_chunk(cfg: Config, dims: Dims, tokens: Optional[float] = None) -> Optional[int]:
    """Tokens per MLP mini-sequence, or None when the MLP runs unchunked (MsT off, or the rank's tokens -- or the
    ``tokens`` of a layer mini-sequence -- fit in one chunk)."""
    if not cfg.memory.mst:
        return None
    c = mlp_chunk_tokens(cfg)
    return c if (dims.tokens if tokens is None else tokens) > c else None


def mst_head_chunk(cfg: Config, dims: Dims) -> Optional[int]:
    """Tokens per LM-head mini-sequence, or None if unchunked (the head's short-sequence rule)."""
    if not cfg.memory.mst:
        return None
    explicit = cfg.memory.mst_head_chunks is not None
    c = head_chunk_tokens(dims.tokens, head_chunk_count(cfg), explicit)
    if not explicit and c >= dims.tokens:
        return None
    return c


# ---- a layer's re-run in mini-sequences (memory.layer_chunk_size) ---------------------------------------------
def layer_chunk_share(cfg: Config, dims: Dims, alpha: float = 0.0) -> Optional[float]:
    """The share of the rank's tokens in one mini-sequence of a layer's re-run, or None when the re-run takes its
    rows at once.

    ``memory.layer_chunk_size`` = c counts local rows of the residual stream (S = s/cp/tp with SP, else s/cp; each
    row holds the micro-batch's b tokens), so a chunk is c/S of the rank's tokens and c * tokens / S of them go
    through the linears (SP all-gathers G = tp blocks of c rows). The re-run covers the dropped S - floor(alpha * S)
    rows under token-wise recompute / Memo (``memory/memo/steps.py``), all S under ``activation_offload:
    checkpoints`` (``memory/chunked_layer.py``, alpha = 0); a chunk that covers them all is no chunking (the
    framework then runs unchunked). Around FPDT's block (the checkpoints mode only: the config refuses chunks with
    token-wise recompute around it) the mini-sequences never cross one of its u chunks: min(c, S / u) rows each."""
    c = cfg.memory.layer_chunk_size
    if c is None:
        return None
    S = dims.tokens_residual // dims.micro_batch
    if dims.fpdt:
        return min(c, S // dims.fpdt_chunks) / S
    rerun = S - int(alpha * S + 1e-9)
    return c / S if c < rerun else None


def qkv_local_bytes(dims: Dims) -> float:
    """q, k (after RoPE) and v of the rank's tokens, local heads, before any all-to-all: what token-wise recompute,
    Memo and the chunked checkpoints mode hold whole for the attention backward."""
    return dims.tokens * (dims.heads_local + 2 * dims.kv_heads_local) * dims.head_dim * dims.compute_bytes


def qkv_rerun_bytes(dims: Dims) -> float:
    """q, k, v of the rank's tokens as ``pre`` returns them: v a view of the QKV projection's output (which stays
    whole), q and k rotated copies -- what token-wise recompute's chunked attention backward recomputes without a
    graph (``memo/steps.py`` ``dropped_qkv``)."""
    return dims.tokens * (2 * dims.heads_local + 3 * dims.kv_heads_local) * dims.head_dim * dims.compute_bytes


def qk_norm_saved(dims: Dims) -> float:
    """What the per-head q/k norms keep for backward (``model.qk_layernorm``; ``model/attention.py`` normalises
    contiguous copies, so no view keeps the QKV projection's output alive): q and k before the norm, in the compute
    dtype, and one fp32 rstd per token and head. Example, Qwen3-32B (64 query, 8 kv heads of 128 a tp rank) on
    196,608 tokens in bf16: 3.4 GiB a layer."""
    if not dims.qk_norm:
        return 0.0
    return dims.tokens * (dims.heads_local + dims.kv_heads_local) * (dims.head_dim * dims.compute_bytes + 4)


def post_norm_saved(dims: Dims) -> float:
    """What one norm on a block's output keeps (``model.post_self_attn_layernorm``, ``post_mlp_layernorm``;
    Gemma's): its input (the block's output, compute dtype, the residual stream's rows) and one fp32 rstd a row.
    Example, hidden 3840 on 131,072 rows a rank in bf16: 0.94 GiB."""
    return dims.tokens_residual * (dims.hidden * dims.compute_bytes + 4)


# ---- activations of one layer ---------------------------------------------------------------------------------
def attention_skeletal(dims: Dims, fpdt_offload: bool) -> list[Item]:
    """Tensors core attention keeps for backward, by implementation.

    local (cp = 1): the fused QKV output stays alive (v is a view of it) + rotated q and k + out + lse.
    ring (p2p): contiguous copies of q, k, v + out + lse + the copy of out that ``linear_proj`` saves.
    Ulysses (a2a, a2a+p2p) and FPDT without offload: q, k, v after the all-to-all (kv heads replicated when fewer
    than ranks), out before and after the reverse all-to-all (the second is ``linear_proj``'s input), lse.
    FPDT with offload: q/k/v/out/lse chunks live in host memory; only ``linear_proj``'s input stays."""
    t, d, a = dims.tokens, dims.head_dim, dims.compute_bytes
    lse = Item("core_attention lse [b, nq/tp, s/cp] fp32", t * dims.heads_local * 4, "attn")
    out = Item("core_attention out [s/cp, b, nq/tp, d]", t * dims.heads_local * d * a, "attn")
    if dims.cp == 1 and not dims.fpdt:  # SDPA on permuted views: the QKV output stays alive through v
        return [Item("linear_qkv out (kept by the v view)", t * (dims.heads_local + 2 * dims.kv_heads_local) * d * a),
                Item("rotated q", t * dims.heads_local * d * a), Item("rotated k", t * dims.kv_heads_local * d * a),
                out, lse]
    proj_in = Item("linear_proj input (out after reverse all-to-all)", t * dims.heads_local * d * a, "attn")
    if not dims.uses_a2a:  # ring: contiguous [b, n, s, d] copies of q, k, v are saved; out is copied for linear_proj
        return [Item("q (contiguous copy)", t * dims.heads_local * d * a),
                Item("k, v (contiguous copies)", 2 * t * dims.kv_heads_local * d * a),
                out, Item("linear_proj input (copy of out)", t * dims.heads_local * d * a, "attn"), lse]
    if dims.fpdt and fpdt_offload:
        return [proj_in]
    kv = dims.kv_heads_after_a2a
    return [Item("q after all-to-all", t * dims.heads_local * d * a), Item("k, v after all-to-all", 2 * t * kv * d * a),
            out, proj_in, lse]


def layer_skeletal(dims: Dims, mlp_chunked: bool, fpdt_offload: bool, token_wise: bool = False) -> list[Item]:
    """Every tensor one transformer layer keeps for its backward (no recompute, no offload); with MsT's chunked MLP
    only its input is kept (``memory/mst/mlp_function.py`` recomputes each chunk in backward)."""
    tr, t, h, d = dims.tokens_residual, dims.tokens, dims.hidden, dims.head_dim
    a, r = dims.compute_bytes, dims.residual_bytes
    items = [Item("layer input [s/cp/tp, b, h] (input_layernorm's input)", tr * h * r, "input")]
    # fused norms on both devices (RMSNorm: model/norm.py's twin on CPU): input + rstd (LayerNorm: + mean)
    norm_extra = [Item("norm rstd/mean", tr * 4 * (1 if dims.rmsnorm else 2))]
    items += norm_extra
    # FPDT with offload: the projection's saved chunk inputs go to the host and the chunks' gradient leaves let go
    # of the block input (attention/fpdt/project.py), so nothing of norm 1's output stays on the device
    if not (dims.fpdt and fpdt_offload):
        items.append(Item("linear_qkv input (norm out, all-gathered with SP)", t * h * a))
        if dims.qk_norm:  # FPDT with offload: inside the chunks' projection graphs, on the host
            items.append(Item("q, k before their norms (contiguous copies) + rstd", qk_norm_saved(dims)))
    if token_wise and not dims.fpdt:
        # recompute full / Memo (memory/memo/steps.py): the layer's slot keeps the local q, k (after RoPE) and v
        # (before any all-to-all), the local attention output and lse -- whatever the cp flavour; the checkpoints
        # mode in mini-sequences (memory/chunked_layer.py) assembles and holds the same whole tensors
        items += [Item("q, k (after RoPE), v (local)", qkv_local_bytes(dims)),
                  Item("attention output (local)", t * dims.heads_local * d * a, "attn"),
                  Item("lse", t * dims.heads_local * 4, "attn")]
    else:
        items += attention_skeletal(dims, fpdt_offload)
    if dims.post_attn_norm:
        items.append(Item("attention block out (post_self_attn_layernorm's input) + rstd", post_norm_saved(dims)))
    items.append(Item("residual after attention (pre_mlp_layernorm's input)", tr * h * r))
    items += norm_extra
    if dims.moe:  # an MoE layer's MLP (every layer taken as one: estimate/moe.py)
        items += [Item(name, b) for name, b in moe.kept_items(dims, mlp_chunked)]
    else:
        items.append(Item("linear_fc1 input (norm out, all-gathered with SP)", t * h * a))
    if not mlp_chunked and not dims.moe:
        if dims.swiglu:
            items += [Item("linear_fc1 out [gate; up]", t * 2 * dims.ffn_local * a),
                      Item("silu(gate)", t * dims.ffn_local * a),
                      Item("silu(gate) * up (linear_fc2 input)", t * dims.ffn_local * a)]
        else:
            items += [Item("linear_fc1 out (gelu input)", t * dims.ffn_local * a),
                      Item("gelu out (linear_fc2 input)", t * dims.ffn_local * a)]
    if dims.post_mlp_norm:
        items.append(Item("MLP out (post_mlp_layernorm's input) + rstd", post_norm_saved(dims)))
    return items


def group_bytes(items: list[Item]) -> dict[str, float]:
    out = {"input": 0.0, "attn": 0.0, "others": 0.0}
    for it in items:
        out[it.group] += it.bytes
    return out


def final_skeletal(dims: Dims, head_chunked: bool) -> list[Item]:
    """Final norm + LM head tensors kept for backward (the last layer's output is the final norm's input)."""
    tr, t, h, a, r = dims.tokens_residual, dims.tokens, dims.hidden, dims.compute_bytes, dims.residual_bytes
    items = [Item("last layer output (final norm input)", tr * h * r)]
    items.append(Item("output_layer input (final norm out, all-gathered with SP)", t * h * a))
    if head_chunked:
        items.append(Item("per-token lse (MsT head)", t * 4))
    else:
        items.append(Item("softmax [s/cp, b, V/tp] fp32 (vocab-parallel cross entropy)", t * dims.vocab_local * 4))
    items.append(Item("labels, masks, per-token loss", t * 40))
    return items


def shared_skeletal(dims: Dims) -> list[Item]:
    """Tensors shared by all layers: RoPE cos/sin [s/cp, b, 1, d] fp32, token ids."""
    return [Item("rope cos, sin", 2 * dims.tokens * dims.head_dim * 4), Item("embedding token ids", dims.tokens * 8)]
