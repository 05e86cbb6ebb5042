"""Transient tensors: created and freed inside one layer's (or the head's) forward or backward (Memo §3.3).

Each function returns the bytes *above* the skeletal tensors alive at that moment. The coefficients follow the
autograd formulas of the ops in ``model/`` and ``parallel/``; the CPU ones were checked against a dispatch-level
tracker of live storages on the tiny model (``tests/estimate/test_estimate_calibration.py`` checks the totals):

* SwiGLU MLP backward: 2·f per token (d of silu·up and of its two inputs alive while fc1's output is still held);
  GeLU MLP backward: f + h.
* Attention backward: h + 2·nq·d + 2·nkv·d per token (incoming grad, grad of the attention output, dq, dk, dv).
* LM head forward: 2·V fp32 per token (logits and the shifted logits of the vocab-parallel cross entropy; plus a bf16
  logits tensor under autocast) and ~40 bytes of per-token vectors.

On CUDA with PyTorch's fused attention kernels (``attention/fused_cuda.py``; ``torch_kernels``), each kernel call
also holds k and v repeated to the query heads (GQA), and in backward dk, dv at the query heads before the group sum
and dout made contiguous when the caller passes a permuted view (``kernel_extra``). These are per call: ring
attention's blocks (half blocks in the zigzag), Ulysses' inner attention after the all-to-all, FPDT's chunks.
cuDNN's and FlashAttention-3 / 4's kernels (``attention/hopper.py``) take the kv heads and the views as they are:
none of that in bf16 / fp16 (``repeats_kv``); in fp32 they fall back to the memory-efficient kernel, which repeats.
"""
from __future__ import annotations

from typing import Optional

from ..config import Config
from ..model.norm import RMS_NORM_SLICE_ELEMS as NORM_SLICE
from .dims import Dims
from .inventory import mst_head_chunk, mst_mlp_chunk, post_norm_saved, qk_norm_saved, qkv_rerun_bytes


def fpdt_chunk_bytes(cfg: Config, dims: Dims) -> dict:
    """Per chunk and rank (FPDT §4, attention/fpdt/pipeline.py): Q = q (or out, dout) in the compute dtype, Qf = an fp32
    accumulator of q's shape, K = k (or v), Kf = fp32 dk (or dv), L = lse (fp32)."""
    c = dims.tokens / dims.fpdt_chunks
    kv = dims.kv_heads_after_a2a
    nq, d, a = dims.heads_local, dims.head_dim, dims.compute_bytes
    return {"Q": c * nq * d * a, "Qf": c * nq * d * 4, "K": c * kv * d * a,
            "Kf": c * kv * d * 4, "L": c * nq * 4}


def torch_kernels(cfg: Config, dims: Dims) -> bool:
    """The attention kernels are called through PyTorch's ops (``fused_cuda.TorchCUDABackend`` and its subclasses
    of ``attention/hopper.py``): on CUDA with ``parallel.attention_backend`` torch, cudnn, fa3, fa4, or auto (which
    ``estimate()`` has resolved to the backend the run picks on the profile's GPU); flash-attn and TransformerEngine
    take fewer kv heads than query heads and need none of ``kernel_extra``."""
    return dims.device == "cuda" and cfg.parallel.attention_backend in ("auto", "torch", "cudnn", "fa3", "fa4")


def repeats_kv(cfg: Config, dims: Dims) -> bool:
    """The dense kernel is handed k, v repeated to the query heads: PyTorch's own (flash, memory-efficient), and
    every backend's fp32 fallback (the memory-efficient kernel); cuDNN's and FlashAttention-3 / 4's take GQA."""
    return cfg.parallel.attention_backend in ("auto", "torch") or dims.compute_bytes == 4


def varlen_extra(dims: Dims, Q: float, KV: float, fq: float, fk: float, backward: bool = True) -> float:
    """Bytes one block's variable-length calls hold (``fused_cuda.TorchCUDABackend.forward_rects`` /
    ``backward_rects``: documents or windows on CUDA) above its q, k, v and the fp32 accumulators, the larger of two
    moments. The rectangles' rows are gathered into packed tensors (no GQA repeat: the kernel takes the kv heads as
    they are). Forward: at the kernel packed q, k, v and its out (fq·Q twice, fk·KV); then, the packed inputs
    freed, the out and the accumulator rows it merges into, gathered in fp32 (fq·Q + f·fq·Q; ``merge.merge_into``
    works in place). Backward: at the kernel packed dout, q, out, k, v and its dq, dk, dv (4 fq·Q, 2 fk·KV); then
    the grads and each one's fp32 copy for the accumulation (f·(fq·Q + fk·KV) more). Example, Llama3-8B, ring cp 8 at
    1M with documents (a rank's q Q = 1 GiB in bf16, KV = 0.5 GiB): an earlier rank's block (fq 1, fk 1/2) holds
    3 GiB in forward, 4.5 GiB in backward."""
    f = 4 / dims.compute_bytes
    if not backward:
        return max(2 * fq * Q + fk * KV, fq * Q * (1 + f))
    return max(4 * fq * Q + 2 * fk * KV, (fq * Q + fk * KV) + f * max(fq * Q, fk * KV / 2))


def kernel_extra(cfg: Config, dims: Dims, Q: float, KV: float, fq: float, fk: float, dout_view: bool = False,
                 backward: bool = True) -> float:
    """Bytes one fused CUDA kernel call holds above a kernel that takes the kv heads as they are (0 with other
    kernels). ``Q``: q of the rank's tokens at the call's heads, ``KV``: k + v at their heads (compute dtype);
    ``fq``, ``fk``: the call's share of those query and key tokens (ring's zigzag blocks: 1/2 or 1). With GQA
    (fewer kv than query heads) k and v repeated to the query heads (``_repeat``: 2·fk·Q), and in backward dk, dv
    at the query heads (2·fk·Q), all alive until the call returns, when dk, dv have been summed to the kv heads;
    ``dout_view``: dout is a permuted view of the caller's ``[s, b, n, d]`` tensor, made contiguous for the kernel
    (fq·Q; freed when the kernel returns, before the sums).

    Example, Llama3-8B (32 query, 8 kv heads) on 8 ranks with Ulysses (4 query heads and 1 kv head a rank, all 1M
    tokens after the all-to-all; Q = 1 GiB, KV = 0.5 GiB): 2 GiB of repeated k, v in forward; in backward, at the
    kernel, 1 (dout) + 2 + 2 GiB beside dq and at the query heads, dk, dv, in place of dk, dv (0.5): 4.5 GiB more."""
    if not torch_kernels(cfg, dims):
        return 0.0
    ranges = varlen_extra(dims, Q, KV, fq, fk, backward) if dims.ranges else 0.0
    if dims.rects_everywhere:
        return ranges  # every block runs the variable-length kernel
    if not repeats_kv(cfg, dims):
        return ranges  # cuDNN / FlashAttention-3 / 4 in bf16: k, v and dout as they are
    return max(ranges, _dense_extra(Q, KV, fq, fk, dout_view, backward))  # full-attention layers: the dense kernels


def _dense_extra(Q: float, KV: float, fq: float, fk: float, dout_view: bool, backward: bool) -> float:
    """``kernel_extra`` of the dense fused kernels (see there)."""
    copy = fq * Q if dout_view else 0.0
    if KV >= 2 * Q:  # as many kv heads as query heads: nothing repeated
        return copy if backward else 0.0
    if not backward:
        return 2 * fk * Q
    return 4 * fk * Q + max(0.0, copy - fk * KV)  # at the kernel (with dout's copy) or at the sums (with dk, dv)


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
    if c:  # one chunk's fc1 output, activation (SwiGLU: silu and product) into the preallocated output
        out = max(out, c * (4 if dims.swiglu else 2) * dims.ffn_local * a)
    elif no_graph:  # fc1 output, activation (SwiGLU: silu and product) of the tokens run without autograd
        out = max(out, min(rows, no_graph * dims.tokens) * (4 if dims.swiglu else 2) * dims.ffn_local * a)
    return out if dims.fpdt else max(out, pre_no_graph(dims, pre_tokens))  # FPDT's block projects chunk by chunk


def _mlp_backward(cfg: Config, dims: Dims, chunk: Optional[float], held: bool = False) -> float:
    """The MLP's backward transient on ``chunk`` tokens at once (None: all the rank's tokens). ``held``: its saved
    tensors live on in a rounding buffer (Memo's kept tokens), so the grads are not offset by their frees."""
    rows, c = _mlp_rows(cfg, dims, chunk)
    if c:  # input grad (the dtype of its input, the norm's output: the residual's) + one chunk recomputed, its grads
        return rows * dims.hidden * dims.residual_bytes + c * (8 if dims.swiglu else 5) * dims.ffn_local \
            * dims.compute_bytes
    if held:  # SwiGLU: d(gate), d(up) and their concatenation; GeLU: d of both activations and the input grad
        return rows * (4 * dims.ffn_local if dims.swiglu else 2 * dims.ffn_local + dims.hidden) * dims.compute_bytes
    return rows * (2 * dims.ffn_local if dims.swiglu else dims.ffn_local + dims.hidden) * dims.compute_bytes


def _ring_backward(cfg: Config, dims: Dims, Q: float, KV: float, R: int, dout_view: bool) -> float:
    """``ring.ring_backward`` above its inputs (Q = q-sized, KV = k + v in the compute dtype): the diagonal
    block's dq (the accumulator itself in fp32; its dk, dv and, under bf16, dq are dropped once copied to fp32); the
    back halves of dout, q and out copied; one off-diagonal block's grads (and the front
    halves of k, v copied); fp32 dk/dv four times (this rank's, the block's, the one received, their sum); k, v
    stacked and received (two in flight when R > 2); the fp32 dq accumulator, a copy only under bf16.

    With PyTorch's fused CUDA kernels the blocks' kernels are the peak, taken moment by moment: at step i of the
    ring, the fp32 dq accumulator and this rank's fp32 dk/dv, the back halves, the k, v in use and (i < R-1) the
    next ones being received, (i >= 2) the previous block's fp32 dk/dv in flight (sent and being received), and the
    block's kernel (``kernel_extra``): back queries x all keys of a later rank (dq over half the tokens, dk, dv over
    all), or all queries x the front keys of an earlier rank (their contiguous copies; dout a view when
    ``dout_view``, as ``backward_with_lse`` passes it); or the diagonal block first, its k, v already in flight to
    the next rank (stacked and being received), or the four fp32 dk/dv of the accumulation."""
    a = dims.compute_bytes
    f = 4 / a
    if not torch_kernels(cfg, dims):
        return (Q if a == 4 else 0.0) + 1.5 * Q + (Q + KV) + 4 * f * KV + (3 if R > 2 else 2) * KV \
            + (f * Q if a < 4 else 0.0)
    if dims.rects_everywhere:
        return _ring_backward_rects(dims, Q, KV, R)
    later = Q / 2 + KV + kernel_extra(cfg, dims, Q, KV, 0.5, 1.0)  # dq over the back half, dk, dv over all keys
    earlier = KV / 2 + Q + KV / 2 + kernel_extra(cfg, dims, Q, KV, 1.0, 0.5, dout_view)
    steps = [f * Q + f * KV + 1.5 * Q + KV * (2 if i + 1 < R else 1) + (2 * f * KV if i >= 2 else 0.0)
             + max(later, earlier) for i in range(1, R)]
    diagonal = Q + KV + 2 * KV + kernel_extra(cfg, dims, Q, KV, 1.0, 1.0, dout_view)
    accumulate = f * Q + 4 * f * KV + 1.5 * Q + 2 * KV
    return max(diagonal, accumulate, *steps)


def _ring_backward_rects(dims: Dims, Q: float, KV: float, R: int) -> float:
    """``ring._ring_backward_rects`` on CUDA (documents or windows on every layer): no half copies; at step i the
    fp32 dq accumulator and this rank's fp32 dk/dv, the k, v in use and (i < R-1) the next ones, the block's fp32
    dk/dv accumulator and (i >= 2) the previous one in flight (sent and being received), and the block's variable-
    length calls (an earlier rank's block: all queries x half the keys; a later one's: half the queries x all);
    first the diagonal block's calls beside its fresh fp32 dq, dk, dv and the k, v in flight to the next rank."""
    f = 4 / dims.compute_bytes
    block = max(varlen_extra(dims, Q, KV, 1.0, 0.5), varlen_extra(dims, Q, KV, 0.5, 1.0))
    steps = [f * Q + f * KV + KV * (2 if i + 1 < R else 1) + f * KV + (2 * f * KV if i >= 2 else 0.0) + block
             for i in range(1, R)]
    diagonal = f * Q + f * KV + 2 * KV + varlen_extra(dims, Q, KV, 1.0, 1.0)
    return max(diagonal, *steps)


def attention_backward_lse(cfg: Config, dims: Dims) -> float:
    """The core attention's backward from its merged out and lse (``attention/core.py``'s protocol, which token-wise
    recompute, Memo and the chunked checkpoints mode call), above q, k, v, out, lse and dout: local, dq, dk, dv;
    ring, ``_ring_backward``; Ulysses (``ulysses.backward_with_lse``), q, k, v received and copied contiguous (the
    received ones dropped), out and dout gathered, then the inner core's backward (local or ring); after it only dq,
    dk, dv, their concatenation and the one received back (each dropped when the next exists). The cores hand the
    kernels ``[b, n, s, d]`` views of their ``[s, b, n, d]`` tensors, dout included (``kernel_extra``)."""
    t, d, a = dims.tokens, dims.head_dim, dims.compute_bytes
    Q = t * dims.heads_local * d * a
    KV = t * 2 * dims.kv_heads_after_a2a * d * a  # (kv heads replicated for the all-to-all)
    # dq, dk, dv: the kernel's, or the variable-length calls' fp32 accumulators (``backward_rects``), cast at the end
    grads = (Q + KV) * (4 / a if torch_kernels(cfg, dims) and dims.rects_everywhere else 1)
    local = grads + kernel_extra(cfg, dims, Q, KV, 1.0, 1.0, dout_view=True)
    if not dims.uses_a2a:
        return local if dims.cp == 1 else _ring_backward(cfg, dims, Q, KV, dims.cp, dout_view=True)
    R = dims.cp // dims.ulysses
    inner = local if R == 1 else _ring_backward(cfg, dims, Q, KV, R, dout_view=True)
    return max(2 * (Q + KV), (Q + KV) + 2 * Q + inner)


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


def fpdt_block_backward(cfg: Config, dims: Dims) -> float:
    """FPDT's block backward (``attention/fpdt/pipeline.py``) above its output grad and the input grad it fills: two
    q sets fetched (q, out, dout, fp32 dq accumulator, lse of a chunk), a kv chunk and its fp32 dk/dv accumulators,
    one block's dq, dk, dv; without offload dout and the dq accumulators of every chunk stay on the device."""
    u, b = dims.fpdt_chunks, fpdt_chunk_bytes(cfg, dims)
    qset = 3 * b["Q"] + b["Qf"] + b["L"]  # q, out, dout, dq accumulator, lse of one q chunk
    # one block's dq, dk, dv (a fused kernel: k, v of the chunk repeated, dk, dv at the query heads)
    grads = b["Q"] + 2 * b["K"] + kernel_extra(cfg, dims, b["Q"], 2 * b["K"], 1.0, 1.0)
    kv = 2 * b["K"] + 2 * b["Kf"]  # kv chunk in use + its fp32 dk/dv accumulators
    if cfg.memory.fpdt_offload:  # bench/fpdt_memory.py: 10Q + 2L + 6K (u >= 3), 5Q + L + 6K (u = 1), fp32
        return kv + (2 * qset if u > 1 else qset) + b["Qf"] + grads
    return u * (b["Q"] + b["Qf"]) + kv + grads


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
