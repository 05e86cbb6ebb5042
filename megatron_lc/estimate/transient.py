"""Transient tensors: created and freed inside one layer's (or the head's) forward or backward (Memo §3.3).

Each function returns the bytes *above* the skeletal tensors alive at that moment. The coefficients follow the
autograd formulas of the ops in ``model/`` and ``parallel/``; the CPU ones were checked against a dispatch-level
tracker of live storages on the tiny model (``tests/test_estimate_calibration.py`` checks the totals):

* SwiGLU MLP backward: 2·f per token (d of silu·up and of its two inputs alive while fc1's output is still held);
  GeLU MLP backward: f + h.
* Attention backward: h + 2·nq·d + 2·nkv·d per token (incoming grad, grad of the attention output, dq, dk, dv).
* LM head forward: 2·V fp32 per token (logits and the shifted logits of the vocab-parallel cross entropy; plus a bf16
  logits tensor under autocast) and ~40 bytes of per-token vectors.
"""
from __future__ import annotations

from ..config import Config
from .inventory import Dims


def mst_mlp_chunk(cfg: Config, x: Dims) -> int:
    """Tokens per MLP mini-sequence (MsT §3.4: C = hidden size), never more than the local tokens."""
    c = cfg.memory.mst_mlp_chunk_size or x.h
    return min(c, x.tokens)


def mst_head_chunks(cfg: Config, x: Dims) -> int:
    """Chunks of the LM head + loss (MsT §3.4: M = V / h)."""
    return cfg.memory.mst_head_chunks or max(1, -(-x.V // x.h))


def fpdt_chunks(cfg: Config, x: Dims) -> int:
    """u: chunks per sequence. ``memory.fpdt_chunk_size`` counts tokens after the all-to-all (a slice of the whole
    sequence gathered over the ulysses ranks); default 64K (FPDT §5.3)."""
    gathered = x.b * x.s // (x.cp // x.ulysses)
    c = cfg.memory.fpdt_chunk_size or 65536
    return max(1, -(-gathered // c))


def layer_forward(cfg: Config, x: Dims) -> float:
    """Peak transient bytes of one layer's forward."""
    t, h, a, d = x.tokens, x.h, x.act, x.d
    out = t * h * a if x.tp == 1 else 2 * t * h * a  # row linear: output + the all-reduce / reduce-scatter copy
    if x.cp > 1 and x.cp_type in ("p2p", "a2a+p2p"):
        kv = x.kv_heads_after_a2a if x.uses_a2a else x.nkv_l
        # k/v being received while the current ones compute (2 buffers) + partial out and fp32 accumulator
        out = max(out, 2 * 2 * t * kv * d * a + 2 * t * x.nq_l * d * 4)
    if x.uses_a2a and x.cp_type != "fpdt":
        out = max(out, 2 * t * x.nq_l * d * a)  # send stack + receive buffer of the largest all-to-all (q)
    if x.cp_type == "fpdt" and x.cp > 1:
        c = t / fpdt_chunks(cfg, x)  # local tokens per chunk (the gathered chunk has ulysses x as many)
        kv = x.kv_heads_after_a2a
        out = max(out, c * ((x.nq_l + 2 * kv) * d * a * 2  # chunk all-to-all send + receive
                            + 2 * 2 * kv * d * a  # double-buffered kv chunks
                            + x.nq_l * d * (4 + a) + x.nq_l * 4))  # fp32 output accumulator, chunk out, lse
    if cfg.memory.mst:
        out = max(out, mst_mlp_chunk(cfg, x) * (4 if x.swiglu else 2) * x.f_l * a)
    return out


def layer_backward(cfg: Config, x: Dims) -> float:
    """Peak transient bytes of one layer's backward (its skeletal tensors are counted elsewhere)."""
    t, h, a, d = x.tokens, x.h, x.act, x.d
    if cfg.memory.mst:
        c = mst_mlp_chunk(cfg, x)
        mlp = t * h * a + c * (8 if x.swiglu else 5) * x.f_l * a  # input grad + one chunk recomputed and its grads
    else:
        mlp = t * (2 * x.f_l if x.swiglu else x.f_l + h) * a
    kv = x.kv_heads_after_a2a
    attn = t * (h + 2 * x.nq_l * d + 2 * kv * d) * a
    if x.cp > 1 and x.cp_type in ("p2p", "a2a+p2p"):
        # fp32 dq accumulator, dk/dv travelling around the ring in fp32 (2 buffers), k/v received (2 buffers)
        attn += t * x.nq_l * d * 4 + 2 * 2 * t * kv * d * 4 + 2 * 2 * t * kv * d * a
    if x.uses_a2a and x.cp_type != "fpdt":
        attn += 2 * t * x.nq_l * d * a
    if x.cp_type == "fpdt" and x.cp > 1:
        u = fpdt_chunks(cfg, x)
        c = t / u
        # chunked: one q-side chunk (q, out, dout, lse) double-buffered, kv chunk + its fp32 dk/dv accumulators,
        # dq accumulators of the whole sequence (fp32; on the device unless offloaded with the chunks)
        chunk = c * (2 * (3 * x.nq_l * d * a + x.nq_l * 4) + 2 * kv * d * (a + 4))
        dq = 0 if cfg.memory.fpdt_offload else t * x.nq_l * d * 4
        attn = t * (h + x.nq_l * d) * a + chunk + dq
    sp = t * h * a if x.sp else 0  # the all-gather of the incoming grad for the row linear's backward
    return max(mlp, attn) + sp


def head_forward(cfg: Config, x: Dims) -> float:
    """Logits and the vocab-parallel cross entropy's fp32 copies (per chunk with MsT)."""
    per_token = x.V_l * (x.act + 4 + (4 if x.act < 4 else 0))
    small = 40
    if cfg.memory.mst:
        c = -(-x.tokens // mst_head_chunks(cfg, x))
        return c * (per_token + x.V_l * 4) + x.tokens * small
    return x.tokens * (per_token + small)


def head_backward(cfg: Config, x: Dims) -> float:
    """Above the saved softmax: its grad cast to the compute dtype, the grad of the hidden states."""
    cast = x.V_l * x.act if x.act < 4 else 0
    if cfg.memory.mst:
        c = -(-x.tokens // mst_head_chunks(cfg, x))
        return c * (x.V_l * (x.act + 4 + 4) + cast) + x.tokens * x.h * x.res
    return x.tokens * (cast + x.h * x.res + 16)


def optimizer_step(x: Dims, local_numels: list[int], state_numel: int, bucket_bytes: int = 64 * 2 ** 20) -> float:
    """Temporaries of grad sync (flattened bucket), clipping (fp64 copy of one grad) and AdamW.

    AdamW on CUDA runs the foreach implementation: ~one fp32 copy of the (local) states; on CPU the per-tensor loop
    needs two temporaries of the largest parameter."""
    largest = max(local_numels)
    sync = min(bucket_bytes + largest * 4, sum(local_numels) * 4) if x.dp * x.cp > 1 else 0
    clip = largest * 16
    adam = state_numel * 4 if x.device == "cuda" else 2 * largest * 4
    return max(sync, clip, adam)
