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
from .inventory import Dims, mst_head_chunk, mst_mlp_chunk


def fpdt_chunk_bytes(cfg: Config, x: Dims) -> dict:
    """Per chunk and rank (FPDT §4, attention/fpdt/pipeline.py): Q = q (or out, dout) in the compute dtype, Qf = an fp32
    accumulator of q's shape, K = k (or v), Kf = fp32 dk (or dv), L = lse (fp32)."""
    c = x.tokens / x.fpdt_chunks
    kv = x.kv_heads_after_a2a
    return {"Q": c * x.nq_l * x.d * x.act, "Qf": c * x.nq_l * x.d * 4, "K": c * kv * x.d * x.act,
            "Kf": c * kv * x.d * 4, "L": c * x.nq_l * 4}


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
    if x.fpdt:
        b = fpdt_chunk_bytes(cfg, x)
        # one chunk's projection out + all-to-all send/receive + contiguous copies, the fp32 output accumulator and
        # its merge temporaries, lse, two kv chunks fetched (double buffer)
        out = max(out, 3 * (b["Q"] + 2 * b["K"]) + 3 * b["Qf"] + 2 * b["L"] + 4 * b["K"])
    c = mst_mlp_chunk(cfg, x)
    if c:  # one chunk's fc1 output, activation (SwiGLU: silu and product) into the preallocated output
        out = max(out, c * (4 if x.swiglu else 2) * x.f_l * a)
    return out


def layer_backward(cfg: Config, x: Dims) -> float:
    """Peak transient bytes of one layer's backward (its skeletal tensors are counted elsewhere)."""
    t, h, a, d = x.tokens, x.h, x.act, x.d
    c = mst_mlp_chunk(cfg, x)
    if c:  # input grad + the MLP's weight grads + one chunk recomputed and its grads
        mlp = t * h * a + c * (8 if x.swiglu else 5) * x.f_l * a
    else:
        mlp = t * (2 * x.f_l if x.swiglu else x.f_l + h) * a
    kv = x.kv_heads_after_a2a
    attn = t * (h + 2 * x.nq_l * d + 2 * kv * d) * a
    if x.cp > 1 and x.cp_type in ("p2p", "a2a+p2p"):
        # fp32 dq accumulator, dk/dv travelling around the ring in fp32 (2 buffers), k/v received (2 buffers)
        attn += t * x.nq_l * d * 4 + 2 * 2 * t * kv * d * 4 + 2 * 2 * t * kv * d * a
    if x.uses_a2a and x.cp_type != "fpdt":
        attn += 2 * t * x.nq_l * d * a
    if x.fpdt:
        u, b = x.fpdt_chunks, fpdt_chunk_bytes(cfg, x)
        qset = 3 * b["Q"] + b["Qf"] + b["L"]  # q, out, dout, dq accumulator, lse of one q chunk
        grads = b["Q"] + 2 * b["K"]  # one block's dq, dk, dv
        kv = 2 * b["K"] + 2 * b["Kf"]  # kv chunk in use + its fp32 dk/dv accumulators
        if cfg.memory.fpdt_offload:  # bench/fpdt_memory.py: 10Q + 2L + 6K (u >= 3), 5Q + L + 6K (u = 1), fp32
            block = kv + (2 * qset if u > 1 else qset) + b["Qf"] + grads
        else:  # dout and the dq accumulators of the whole sequence stay on the device
            block = u * (b["Q"] + b["Qf"]) + kv + grads
        # + the block's output grad (linear_proj's input grad) and the input grad it fills
        attn = t * x.nq_l * d * a + x.tokens_res * h * x.res + block
    sp = t * h * a if x.sp else 0  # the all-gather of the incoming grad for the row linear's backward
    return max(mlp, attn) + sp


def head_forward(cfg: Config, x: Dims) -> float:
    """Logits and the vocab-parallel cross entropy's fp32 copies; with MsT per chunk, plus the gradient the MsT head
    computes in forward (memory/mst/head_function.py: u = (softmax - onehot) W ``[N, h]`` and the weight-gradient sum
    ``[V/tp, h]`` fp32, which becomes the weight's ``.grad``)."""
    small = 40
    c = mst_head_chunk(cfg, x)
    if c:
        chunk = c * x.V_l * (4 + (x.act if x.act < 4 else 0))
        return x.tokens * x.h * x.act + x.V_l * x.h * 4 + chunk + x.tokens * 12
    return x.tokens * (x.V_l * (x.act + 4 + (4 if x.act < 4 else 0)) + small)


def head_backward(cfg: Config, x: Dims) -> float:
    """Above the saved softmax: its grad cast to the compute dtype, the grad of the hidden states (MsT: u turns
    into the input grad in place; nothing else)."""
    if mst_head_chunk(cfg, x):
        return x.tokens * x.h * x.act  # (the weight-gradient sum is the head grad, counted with the grads)
    cast = x.V_l * x.act if x.act < 4 else 0
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
