"""Transient tensors: created and freed inside one layer's (or the head's) forward or backward (Memo §3.3).

Each function returns the bytes *above* the skeletal tensors alive at that moment. The coefficients follow the
autograd formulas of the ops in ``model/`` and ``parallel/``; the CPU ones were checked against a dispatch-level
tracker of live storages on the tiny model (``tests/estimate/test_estimate_calibration.py`` checks the totals):

* SwiGLU MLP backward: 2·f per token (d of silu·up and of its two inputs alive while fc1's output is still held);
  GeLU MLP backward: f + h.
* Attention backward: h + 2·nq·d + 2·nkv·d per token (incoming grad, grad of the attention output, dq, dk, dv).
* LM head forward: 2·V fp32 per token (logits and the shifted logits of the vocab-parallel cross entropy; plus a bf16
  logits tensor under autocast) and ~40 bytes of per-token vectors.

What the attention kernels hold inside a call (GQA repeats, variable-length calls, the ring's and FPDT's moments)
is ``attention_kernels.py``'s; the layer's moments here add it to the rest of the layer.
"""
from __future__ import annotations

from typing import Optional

from ..config import Config
from ..model.norm import RMS_NORM_SLICE_ELEMS as NORM_SLICE
from . import moe
from .attention_kernels import attention_backward_lse, fpdt_block_backward, fpdt_chunk_bytes, kernel_extra
from .dims import Dims
from .inventory import mst_head_chunk, mst_mlp_chunk, post_norm_saved, qk_norm_saved, qkv_rerun_bytes


def _norm_backward(dims: Dims, rows: float) -> float:
    """A norm's backward on ``rows`` residual rows above its saved input and incoming grad: its input grad (residual
    dtype: the norms run in their input's dtype); on CPU the twin of ``model/norm.py`` also holds x·rstd and the
    incoming grad times it in fp32 while it reduces them, one slice of ``RMS_NORM_SLICE_ELEMS`` elements at a time
    (and the incoming grad times the weight in fp32 when the residual is not fp32); torch's fused kernel on CUDA
    holds none."""
    full = rows * dims.hidden
    if dims.device == "cuda":
        return full * dims.residual_bytes
    return full * dims.residual_bytes + min(full, NORM_SLICE) * 4 * (2 if dims.residual_bytes == 4 else 3)


def _mlp_rows(cfg: Config, dims: Dims, chunk: Optional[float]) -> tuple[float, Optional[float]]:
    """(tokens through the MLP at once, MsT's chunk within them or None): a layer mini-sequence of ``chunk`` tokens
    (None: all the rank's tokens) and MsT's chunk, the smaller governing."""
    rows = dims.tokens if chunk is None else min(chunk, dims.tokens)
    return rows, mst_mlp_chunk(cfg, dims, rows)


def pre_no_graph(dims: Dims, n: float, graph: bool = False) -> float:
    """Peak bytes of ``pre`` (norm, QKV, RoPE) on ``n`` tokens (through the linears) while q is rotated: the norm
    output (local rows, in the residual dtype: the norm runs in its input's dtype; the caller's frame holds it),
    with ``graph`` its cast to the compute dtype that the QKV projection saves (all-gathered with SP; without autograd
    it is freed with the projection), the projection's output, q copied out of it (when a rank has several kv
    groups), and RoPE's fp32 temporaries of q (``model/rope.apply_rotary``: x·cos and one half's product, 1.5 q-sized
    fp32 tensors). With per-head q/k norms (``model.qk_layernorm``): q and k copied contiguous (what the norms
    save), their normalised outputs (RoPE's inputs) and an fp32 rstd a token and head: 2 (nq + nkv) d, where q's
    copy out of the projection is the first of them."""
    q_copy = dims.heads_local if dims.kv_heads_local > 1 else 0
    h, d, a, nq, nkv = dims.hidden, dims.head_dim, dims.compute_bytes, dims.heads_local, dims.kv_heads_local
    qk_norm = ((2 * (nq + nkv) - q_copy) * d * a + (nq + nkv) * 4) if dims.qk_norm else 0.0
    return n * (h * dims.residual_bytes * dims.tokens_residual / dims.tokens + (h * a if graph else 0)
                + (nq + 2 * nkv + q_copy) * d * a + 1.5 * nq * d * 4 + qk_norm)


def layer_forward(cfg: Config, dims: Dims, chunk: Optional[float] = None, no_graph: float = 0.0,
                  pre_tokens: float = 0.0) -> float:
    """Peak transient bytes of one layer's forward. ``chunk``: tokens (through the linears) of a mini-sequence of
    ``memory.layer_chunk_size``; ``no_graph``: the share of the rank's tokens whose ``post`` runs without autograd
    (the dropped tokens of token-wise recompute / Memo, all of them in the checkpoints mode): their MLP
    intermediates are transient, one chunk at a time when chunked; ``pre_tokens``: tokens whose ``pre`` runs
    without autograd at once (token-wise: all dropped ones; checkpoints: a chunk)."""
    t, h, a, d = dims.tokens, dims.hidden, dims.compute_bytes, dims.head_dim
    out = t * h * a if dims.tp == 1 else 2 * t * h * a  # row linear: output + the all-reduce / reduce-scatter copy
    kv = dims.kv_heads_after_a2a if dims.uses_a2a else dims.kv_heads_local
    Q, KV = t * dims.heads_local * d * a, 2 * t * kv * d * a
    rep = kernel_extra(cfg, dims, Q, KV, 1, 1, backward=False)  # k, v repeated for a fused kernel (whole keys)
    if dims.cp > 1 and dims.cp_comm_type in ("p2p", "a2a+p2p"):
        # k/v being received while the current ones compute (2 buffers) + partial out and fp32 accumulator
        out = max(out, 2 * 2 * t * kv * d * a + 2 * t * dims.heads_local * d * 4 + rep)
    if dims.uses_a2a and dims.cp_comm_type != "fpdt":
        out = max(out, 2 * t * dims.heads_local * d * a)  # send stack + receive buffer of the largest all-to-all (q)
        if rep:  # the inner kernel: q, k, v after the all-to-all, its out
            out = max(out, Q + KV + Q + rep)
    if dims.cp == 1 and not dims.fpdt and rep:  # the local kernel's out beside the repeated k, v
        out = max(out, Q + rep)
    if dims.fpdt:
        b = fpdt_chunk_bytes(cfg, dims)
        # one chunk's projection out + all-to-all send/receive + contiguous copies, the fp32 output accumulator and
        # its merge temporaries, lse, two kv chunks fetched (double buffer); a fused kernel's repeated k, v chunk
        block = 3 * (b["Q"] + 2 * b["K"]) + 3 * b["Qf"] + 2 * b["L"] + 4 * b["K"] \
            + kernel_extra(cfg, dims, b["Q"], 2 * b["K"], 1, 1, backward=False)
        if chunk is not None and no_graph:
            # the block in the chunked checkpoints mode (memory/chunked_layer.BlockAttentionPart): its whole output
            # before the out-projection, beside its chunks, then beside the layer output post fills chunk by chunk
            # (the out-projection's output and the MLP's intermediates of one mini-sequence)
            c = _mlp_rows(cfg, dims, chunk)[1] or chunk
            post = chunk * h * a * (1 if dims.tp == 1 else 2) + c * (4 if dims.swiglu else 2) * dims.ffn_local * a
            return t * dims.heads_local * d * a + max(block, dims.tokens_residual * h * dims.residual_bytes + post)
        out = max(out, block)
    rows, c = _mlp_rows(cfg, dims, chunk)
    if dims.moe:  # the dispatch's copies and the experts' output (MsT: a chunk's whole set; estimate/moe.py)
        out = max(out, moe.forward_transient(dims, c))
    elif c:  # one chunk's fc1 output, activation (SwiGLU: silu and product) into the preallocated output
        out = max(out, c * (4 if dims.swiglu else 2) * dims.ffn_local * a)
    elif no_graph:  # fc1 output, activation (SwiGLU: silu and product) of the tokens run without autograd
        out = max(out, min(rows, no_graph * dims.tokens) * (4 if dims.swiglu else 2) * dims.ffn_local * a)
    return out if dims.fpdt else max(out, pre_no_graph(dims, pre_tokens))  # FPDT's block projects chunk by chunk


def _mlp_backward(cfg: Config, dims: Dims, chunk: Optional[float], held: bool = False) -> float:
    """The MLP's backward transient on ``chunk`` tokens at once (None: all the rank's tokens). ``held``: its saved
    tensors live on in a rounding buffer (Memo's kept tokens), so the grads are not offset by their frees."""
    rows, c = _mlp_rows(cfg, dims, chunk)
    if dims.moe:
        return moe.backward_transient(dims, c)
    if c:  # input grad (the dtype of its input, the norm's output: the residual's) + one chunk recomputed, its grads
        return rows * dims.hidden * dims.residual_bytes + c * (8 if dims.swiglu else 5) * dims.ffn_local \
            * dims.compute_bytes
    if held:  # SwiGLU: d(gate), d(up) and their concatenation; GeLU: d of both activations and the input grad
        return rows * (4 * dims.ffn_local if dims.swiglu else 2 * dims.ffn_local + dims.hidden) * dims.compute_bytes
    return rows * (2 * dims.ffn_local if dims.swiglu else dims.ffn_local + dims.hidden) * dims.compute_bytes


def tokenwise_backward(cfg: Config, dims: Dims, rerun: float, merged: float = 0.0) -> float:
    """One layer's backward under token-wise recompute / Memo with the dropped tokens (share ``rerun``) re-run at
    once (``memory/memo/steps.py``), above the layer's kept tensors (the rounding buffer or the recompute slot); the
    re-run's own tensors are counted here. ``merged``: kept and dropped q, k, v (and out, dout with SP) merged for
    the kernel (Memo's 0 < alpha < 1). The largest of these moments, in autograd's order (U: one residual-stream
    tensor of the rank, fp32; Q: q of the rank's tokens):

    * dropped post: beside the incoming grad dy (U) and the dropped rows' dx and dout (``PostDropped.backward``'s
      buffers), the re-run's forward at its MLP; its saved tensors (the residual after attention; norm 2's output
      in the compute dtype, gathered with SP, as fc1 or MsT keep it; the MLP's intermediates unless MsT chunks
      them) and the MLP's backward; norm 2's backward (its incoming grad and its input grad, residual dtype, beside
      the saved residual); the out projection's (the summed residual grad, with SP the incoming grad all-gathered,
      dout's rows);
    * kept post (Memo's kept tokens, after the dropped ones): the MLP's backward from tensors held in the buffer;
    * pre: the dropped tokens' pre re-run with its graph just before the attention backward (``pre_no_graph``),
      beside the layer input's grad (both parts: U) and dout;
    * attention: the same with pre's saved tensors (norm 1's output in the compute dtype, gathered with SP; the QKV
      output, kept by the v view; q, k after RoPE), ``merged`` and the core's backward (``attention_backward_lse``).

    Example, one H100 at 512K tokens (Llama3-8B, every token re-run, MsT, bf16): U = 8 GiB, Q = 4 GiB; the pre
    moment is 8 + 4 + 8 (norm 1's fp32 output) + 4 (its bf16 cast) + 6 (the QKV output) + 4 (q copied out of it) +
    12 (RoPE's fp32 temporaries of q) = 46 GiB, the attention moment 51 GiB (the largest)."""
    t, tr, h, d = dims.tokens, dims.tokens_residual, dims.hidden, dims.head_dim
    a, r = dims.compute_bytes, dims.residual_bytes
    U, Q = tr * h * r, t * dims.heads_local * d * a
    dropped, kept = rerun, 1.0 - rerun
    moments = []
    if dropped:
        rows, mst = _mlp_rows(cfg, dims, dropped * t)
        held = dropped * (U + tr * 4 + t * h * a + (0.0 if mst else t * (4 if dims.swiglu else 2) * dims.ffn_local * a)
                          + (dims.post_attn_norm + dims.post_mlp_norm) * post_norm_saved(dims))
        base = U + dropped * (U + Q)  # dy; the dropped rows' dx and dout
        # the re-run's forward at its MLP: the residual, norm 2's output, the out projection's output (the frames
        # hold them), the MLP's input all-gathered with SP, its output (+ the reduce copy under tp), MsT's chunk
        mlp_fwd = t * h * a * (1 if dims.tp == 1 else 2) + (mst * (4 if dims.swiglu else 2) * dims.ffn_local * a
                                                            if mst else 0.0)
        moments += [base + dropped * (3 * U + (t * h * r if dims.sequence_parallel else 0.0) + mlp_fwd),
                    base + held + _mlp_backward(cfg, dims, rows),
                    base + dropped * (U + U) + _norm_backward(dims, dropped * tr),
                    base + dropped * (U + Q) + (dropped * t * h * r if dims.sequence_parallel else 0.0)]
    if kept:
        moments.append(U + dropped * (U + Q) + _mlp_backward(cfg, dims, kept * t, held=True))
    pre_saved = dropped * (t * h * a + qkv_rerun_bytes(dims) + qk_norm_saved(dims))
    moments += [U + Q + pre_no_graph(dims, dropped * t, graph=True),
                U + Q + pre_saved + merged + attention_backward_lse(cfg, dims)]
    return max(moments)


def _fpdt_chunked_backward(cfg: Config, dims: Dims, chunk: float, chunk_saved: float, prefetch: float) -> float:
    """FPDT's block as the attention of the chunked checkpoints mode (``memory/chunked_layer.BlockAttentionPart``),
    above the fetched input: the incoming dy and the layer's dx whole through its backward; post re-run and
    backpropagated a chunk at a time beside the block's whole output and its grad dout; then the block's backward
    beside dout and the input grad it fills; then that input grad beside the prefetched next input."""
    t, h, a, d = dims.tokens, dims.hidden, dims.compute_bytes, dims.head_dim
    U, T = dims.tokens_residual * h * dims.residual_bytes, t * dims.heads_local * d * a
    post = 2 * T + chunk_saved + _mlp_backward(cfg, dims, chunk) + (chunk * h * a if dims.sequence_parallel else 0)
    if _mlp_rows(cfg, dims, chunk)[1]:  # MsT's fp32 weight-gradient buffers of each call, added to the grads
        post += ((2 if dims.swiglu else 1) + 1) * dims.ffn_local * h * 4
    return 2 * U + max(post, T + U + fpdt_block_backward(cfg, dims), U + prefetch)


def layer_backward(cfg: Config, dims: Dims, rerun: Optional[float] = None, chunk: Optional[float] = None,
                   chunk_saved: float = 0.0, attn_saved: float = 0.0, prefetch: float = 0.0) -> float:
    """Peak transient bytes of one layer's backward (its skeletal tensors are counted elsewhere).

    ``rerun``: None for a layer under autograd (no recompute, or the whole-layer re-run of the checkpoints mode);
    else the share of the rank's tokens re-run through the core attention's (out, lse) pair (1 - alpha with Memo,
    1 for recompute full and the chunked checkpoints mode). ``chunk``: tokens (through the linears) of a re-run
    mini-sequence of ``memory.layer_chunk_size``; ``chunk_saved``: the tensors one chunk's re-run saves;
    ``attn_saved``: what is recomputed for the attention backward only (chunked token-wise recompute: the dropped
    tokens' q, k, v, after their post has been backpropagated); ``prefetch``: the next layer's input, prefetched by
    the chunked checkpoints mode after the attention backward, while pre is backpropagated a chunk at a time next to
    dq, dk, dv."""
    t, h, a, d = dims.tokens, dims.hidden, dims.compute_bytes, dims.head_dim
    mlp = _mlp_backward(cfg, dims, chunk)
    kv = dims.kv_heads_after_a2a
    if rerun is not None and dims.fpdt:
        return _fpdt_chunked_backward(cfg, dims, chunk, chunk_saved, prefetch)
    if rerun is not None and not dims.fpdt:
        # Memo's 0 < alpha < 1: kept and dropped q, k, v merged (with SP also out and dout) for the kernel
        nq, sp = dims.heads_local, dims.sequence_parallel
        merged = t * (nq + 2 * dims.kv_heads_local + (2 * nq if sp else 0)) * d * a if 0 < rerun < 1 else 0.0
        if chunk is None:
            return tokenwise_backward(cfg, dims, rerun, merged)
        attn = merged + attention_backward_lse(cfg, dims)
        # mini-sequences: the re-run rows' dx and the whole dout live through the layer's backward, the incoming dy
        # through post's backward (through the whole layer's in the checkpoints mode); post is backpropagated a chunk
        # at a time (its MLP, the all-gather of its incoming grad with SP), the core attention whole into dq, dk, dv
        whole = dims.tokens_residual * h * dims.residual_bytes * rerun + t * dims.heads_local * d * a
        dy = dims.tokens_residual * h * dims.residual_bytes
        post = dy + chunk_saved + mlp + (chunk * h * a if dims.sequence_parallel else 0)
        if _mlp_rows(cfg, dims, chunk)[1]:  # MsT's fp32 weight-gradient buffers of each call, added to the grads
            post += ((2 if dims.swiglu else 1) + 1) * dims.ffn_local * h * 4
        kept = (1 - rerun) * t
        if kept:  # Memo's kept tokens: post backpropagated whole, its saved tensors in the rounding buffer
            post = max(post, _mlp_backward(cfg, dims, kept, held=True)
                       + (kept * h * a if dims.sequence_parallel else 0))
        if not attn_saved:  # the checkpoints mode: q, k, v already whole (counted by the caller), dy held
            # pre's phase: q, k, v, out, lse, dout freed (the caller's q, k, v, out, lse are counted whole, so this
            # phase adds only what exceeds them: the prefetched input and pre's chunk next to dq, dk, dv)
            pre = dy + prefetch + chunk_saved - t * dims.heads_local * d * a
            return whole + max(post, dy + attn, pre)
        # token-wise: the dropped tokens' pre re-run without a graph (all at once) for the attention backward
        return whole + max(post, attn_saved + attn, pre_no_graph(dims, rerun * t))
    attn = t * (h + 2 * dims.heads_local * d + 2 * kv * d) * a
    if dims.cp > 1 and dims.cp_comm_type in ("p2p", "a2a+p2p"):
        # fp32 dq accumulator, dk/dv travelling around the ring in fp32 (2 buffers), k/v received (2 buffers)
        attn += t * dims.heads_local * d * 4 + 2 * 2 * t * kv * d * 4 + 2 * 2 * t * kv * d * a
    if dims.uses_a2a and dims.cp_comm_type != "fpdt":
        attn += 2 * t * dims.heads_local * d * a
    if dims.cp > 1 and not dims.fpdt:  # ring attention's kernels (Ulysses' inner one too), a block of all the keys
        attn += kernel_extra(cfg, dims, t * dims.heads_local * d * a, 2 * t * kv * d * a, 1.0, 1.0)
    if dims.fpdt:
        # the block's output grad (linear_proj's input grad) and the input grad it fills
        attn = t * dims.heads_local * d * a + dims.tokens_residual * h * dims.residual_bytes + fpdt_block_backward(
            cfg, dims)
    sp = t * h * a if dims.sequence_parallel else 0  # the all-gather of the incoming grad for the row linear's backward
    # the MLP's backward beside the layer's incoming grad dy (residual dtype; autograd frees it once norm 2's input
    # grad is added to it) and its cast to the MLP output's dtype, the MLP's incoming grad
    dy = dims.tokens_residual * h * (dims.residual_bytes + (a if a != dims.residual_bytes else 0))
    return max(dy + mlp, attn) + sp


def head_forward(cfg: Config, dims: Dims) -> float:
    """Logits and the vocab-parallel cross entropy's fp32 copies; with MsT per chunk, plus the gradient the MsT head
    computes in forward (memory/mst/head_function.py: u = (softmax - onehot) W ``[N, h]`` and the weight-gradient sum
    ``[V/tp, h]`` fp32, which becomes the weight's ``.grad``)."""
    small = 40
    c = mst_head_chunk(cfg, dims)
    if c:
        chunk = c * dims.vocab_local * (4 + (dims.compute_bytes if dims.compute_bytes < 4 else 0))
        h = dims.hidden
        return dims.tokens * h * dims.compute_bytes + dims.vocab_local * h * 4 + chunk + dims.tokens * 12
    return dims.tokens * (dims.vocab_local * (dims.compute_bytes + 4 + (4 if dims.compute_bytes < 4 else 0)) + small)


def head_backward(cfg: Config, dims: Dims) -> float:
    """Above the saved softmax: its grad cast to the compute dtype, the grad of the hidden states (MsT: u turns
    into the input grad in place; nothing else)."""
    if mst_head_chunk(cfg, dims):
        # (the weight-gradient sum is the head grad, counted with the grads)
        return dims.tokens * dims.hidden * dims.compute_bytes
    cast = dims.vocab_local * dims.compute_bytes if dims.compute_bytes < 4 else 0
    return dims.tokens * (cast + dims.hidden * dims.residual_bytes + 16)


def optimizer_step(dims: Dims, local_numels: list[int], state_numel: int, bucket_bytes: int = 64 * 2 ** 20) -> float:
    """Temporaries of grad sync (flattened bucket), clipping (fp64 copy of one grad) and AdamW.

    AdamW on CUDA runs the foreach implementation: ~one fp32 copy of the (local) states; on CPU the per-tensor loop
    needs two temporaries of the largest parameter."""
    largest = max(local_numels)
    sync = min(bucket_bytes + largest * 4, sum(local_numels) * 4) if dims.dp * dims.cp > 1 else 0
    clip = largest * 16
    adam = state_numel * 4 if dims.device == "cuda" else 2 * largest * 4
    return max(sync, clip, adam)
