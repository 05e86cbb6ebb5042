"""Transient bytes of the attention kernels: created and freed inside one attention call's forward or backward
(Memo §3.3), the part of ``transient.py``'s layer moments that depends on the kernel and the context-parallel core.

* Attention backward from the merged out and lse (``attention_backward_lse``): local, ring (``_ring_backward``,
  moment by moment along the ring) and Ulysses (the all-to-all's copies around the inner core).
* FPDT's chunks (``fpdt_chunk_bytes``, ``fpdt_block_backward``): a q / kv chunk of the full sequence at a rank's heads.
* On CUDA with PyTorch's fused attention kernels (``attention/fused_cuda.py`` and ``attention/hopper.py``;
  ``torch_kernels``), what each kernel call holds beyond its inputs and outputs (``kernel_extra``): what the kernels
  allocate inside themselves, from ``device/kernel_scratch.py`` -- the table the rehearsal charges at each op --
  (FlashAttention-2's fp32 dq accumulator and, under GQA, dk, dv at the query heads; cuDNN's fp32 dQ accumulator;
  the memory-efficient kernel's delta), the copies the calls make (fp32: k, v repeated to the query heads, the one
  kernel without GQA; cuDNN: gapped q, k, v made dense), dout's contiguous copy where the kernel's transpose of it is
  not contiguous (a batch above 1). These are per call: ring attention's blocks (half blocks in the zigzag),
  Ulysses' inner attention after the all-to-all, FPDT's chunks. Documents and windows as ranges run
  variable-length calls (``varlen_extra``).
"""
from __future__ import annotations

from ..attention.fused_cuda import MAX_CALL_ROWS
from ..config import Config
from ..device.kernel_scratch import (cudnn_workspace, efficient_workspace, flash_workspace, gqa_expanded,
                                     kept_workspaces, total)
from .dims import Dims
from .ring_balance import ring_balance


def kernel_workspaces(dims: Dims) -> float:
    """What a CUDA run keeps from its first matmul and collectives on (``kernel_scratch.kept_workspaces``, the
    rehearsal's kept charges): cuBLAS's workspaces and NCCL's buffers per communicator that carries device tensors in
    a step -- tp's, the ring's, Ulysses', dp x cp's (FSDP2's gathers and reduce-scatters, the gradients'). Example,
    tp 2 x Ulysses 4: 3 communicators, 448 MiB."""
    if dims.device != "cuda":
        return 0.0
    groups = (dims.tp, dims.cp // dims.ulysses if dims.cp_comm_type != "fpdt" else 1, dims.ulysses if dims.uses_a2a
              else 1, dims.dp * dims.cp)
    return float(total(kept_workspaces(sum(n > 1 for n in groups))))


def fpdt_chunk_bytes(cfg: Config, dims: Dims) -> dict:
    """Per chunk and rank (FPDT §4, attention/fpdt/pipeline.py): Q = q (or out, dout) in the compute dtype, Qf = an
    fp32 accumulator of q's shape, K = k (or v), Kf = fp32 dk (or dv), L = lse (fp32)."""
    c = dims.tokens / dims.fpdt_chunks
    kv = dims.kv_heads_after_a2a
    nq, d, a = dims.heads_local, dims.head_dim, dims.compute_bytes
    return {"Q": c * nq * d * a, "Qf": c * nq * d * 4, "K": c * kv * d * a,
            "Kf": c * kv * d * 4, "L": c * nq * 4}


def torch_kernels(cfg: Config, dims: Dims) -> bool:
    """The attention kernels are called through PyTorch's ops (``fused_cuda.TorchCUDABackend`` and its subclasses
    of ``attention/hopper.py``): on CUDA with ``parallel.attention_backend`` torch, cudnn, fa3, fa4, or auto (which
    ``estimate()`` has resolved to the backend the run picks on the profile's GPU); flash-attn and TransformerEngine
    are not read here (``kernel_extra`` 0)."""
    return dims.device == "cuda" and cfg.parallel.attention_backend in ("auto", "torch", "cudnn", "fa3", "fa4")


def repeats_kv(cfg: Config, dims: Dims) -> bool:
    """The dense kernel is handed k, v repeated to the query heads: only the memory-efficient kernel, every
    backend's fp32 path (it takes no GQA); flash, cuDNN and FlashAttention-3 / 4 take the kv heads as they are."""
    return dims.compute_bytes == 4


def _rowheads(dims: Dims, Q: float) -> float:
    """Rows times heads of a q-sized tensor of ``Q`` bytes (the unit of ``device/kernel_scratch.py``'s formulas)."""
    return Q / (dims.head_dim * dims.compute_bytes)


def _flash_scratch(dims: Dims, Q: float, KV: float, fq: float, fk: float) -> float:
    """What FlashAttention-2's backward holds inside itself for a call over ``fq`` of the queries and ``fk`` of the
    keys (``kernel_scratch.flash_workspace``, and ``gqa_expanded`` with fewer kv than query heads: KV < 2Q)."""
    out = total(flash_workspace(_rowheads(dims, fq * Q), dims.head_dim))
    if KV < 2 * Q:
        out += total(gqa_expanded(_rowheads(dims, fk * Q), dims.head_dim, dims.compute_bytes))
    return out


def varlen_extra(dims: Dims, Q: float, KV: float, fq: float, fk: float, backward: bool = True) -> float:
    """Bytes one block's variable-length calls hold (``fused_cuda.TorchCUDABackend.forward_rects`` /
    ``backward_rects``: documents or windows on CUDA) above its q, k, v and the fp32 accumulators, the larger of two
    moments. The rectangles' rows are gathered into packed tensors (no GQA repeat: the kernel takes the kv heads as
    they are). Forward: at the kernel packed q, k, v and its out (fq·Q twice, fk·KV); then, the packed inputs
    freed, the out and the accumulator rows it merges into, gathered in fp32 (fq·Q + f·fq·Q; ``merge.merge_into``
    works in place). Backward: at the kernel packed dout, q, out, k, v and its dq, dk, dv (4 fq·Q, 2 fk·KV) and what
    it holds inside itself (``_flash_scratch``: the fp32 dq accumulator, f·fq·Q, and under GQA dk, dv at the query
    heads, 2 fk·Q); then the grads and each one's fp32 copy for the accumulation, added in by ``index_add_`` (no
    copy of the accumulator): f·(fq·Q + fk·KV) more, one at a time. Each call has at most ``MAX_CALL_ROWS`` rows
    (``fused_cuda._bounded``), or one document's. Example, Llama3-8B, Ulysses cp 4 + tp 2 at 4M with documents (the
    inner attention: 4M rows, 4 query heads and 1 kv head; Q = 4 GiB, KV = 2 GiB in bf16), calls of 512K rows
    (fq = fk = 1/8): 2 + 0.5 + 1.0 + 1.0 = 4.5 GiB at the kernel in backward (one call over the 4M rows: 36.1)."""
    f = 4 / dims.compute_bytes
    # a call's rows at most MAX_CALL_ROWS, or one rectangle's (a document: its mean length, ``reach``): its share of
    # the block's rows, at the call's heads (Ulysses' and FPDT's after the all-to-all)
    heads = dims.heads_local / (dims.ulysses if dims.uses_a2a else 1)
    cap = max(MAX_CALL_ROWS, dims.reach) * heads * dims.head_dim * dims.compute_bytes / Q
    fq, fk = min(fq, cap), min(fk, cap)
    if not backward:
        return max(2 * fq * Q + fk * KV, fq * Q * (1 + f))
    return max(4 * fq * Q + 2 * fk * KV + _flash_scratch(dims, Q, KV, fq, fk),
               (fq * Q + fk * KV) + f * max(fq * Q, fk * KV / 2))


def kernel_extra(cfg: Config, dims: Dims, Q: float, KV: float, fq: float, fk: float, dout_view: bool = False,
                 backward: bool = True) -> float:
    """Bytes one fused CUDA kernel call holds above its inputs and its own outputs (0 with other kernels). ``Q``: q
    of the rank's tokens at the call's heads, ``KV``: k + v at their heads (compute dtype); ``fq``, ``fk``: the
    call's share of those query and key tokens (ring's zigzag blocks: 1/2 or 1); ``dout_view``: dout is a permuted
    view of the caller's ``[s, b, n, d]`` tensor (the cores' ``to_bnsd``), whose ``[b, s, n, d]`` transpose the
    kernel makes contiguous itself -- a copy only with a batch above 1 (``_dense_extra``).

    Example, Llama3-8B (32 query, 8 kv heads) on 8 ranks with Ulysses (4 query heads and 1 kv head a rank, all 1M
    tokens after the all-to-all; Q = 1 GiB, KV = 0.5 GiB), ``torch`` in bf16: nothing in forward; in backward,
    inside the flash kernel, its fp32 dq accumulator (2 GiB) and dk, dv at the 4 query heads (2 GiB): 4.02 GiB."""
    if not torch_kernels(cfg, dims):
        return 0.0
    ranges = varlen_extra(dims, Q, KV, fq, fk, backward) if dims.ranges else 0.0
    if dims.rects_everywhere:
        return ranges  # every block runs the variable-length kernel
    return max(ranges, _dense_extra(cfg, dims, Q, KV, fq, fk, dout_view, backward))  # full-attention layers


def _dense_extra(cfg: Config, dims: Dims, Q: float, KV: float, fq: float, fk: float, dout_view: bool,
                 backward: bool) -> float:
    """``kernel_extra`` of the dense fused kernels (see there): bf16 / fp16 through flash (``torch``, FlashAttention-3
    / 4 by the same aten op) or cuDNN, fp32 through the memory-efficient kernel."""
    copy = fq * Q if dout_view and dims.micro_batch > 1 else 0.0  # the kernel's own dout.contiguous()
    gqa = KV < 2 * Q
    if repeats_kv(cfg, dims):  # fp32: k, v repeated for the kernel, dk, dv at the query heads until summed
        if not backward:
            return 2 * fk * Q if gqa else 0.0
        delta = total(efficient_workspace(_rowheads(dims, fq * Q)))
        return (4 * fk * Q + max(0.0, copy - fk * KV) if gqa else copy) + delta
    if not backward:
        return 0.0
    if cfg.parallel.attention_backend == "cudnn":
        # cuDNN's dQ accumulator and softmax sums; q, k, v made dense (``hopper.dense``) unless they came through
        # an all-to-all (fresh tensors): local and ring attention hand views of the QKV projection's output
        dense = 0.0 if dims.uses_a2a else fq * Q + fk * KV
        return dense + copy + total(cudnn_workspace(_rowheads(dims, fq * Q), dims.head_dim))
    return copy + _flash_scratch(dims, Q, KV, fq, fk)


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
    bal = ring_balance(dims)
    if dims.cp_layout == "balanced" and bal is not None and bal.steps:
        return _exchange_backward(dims, Q, KV, bal.steps)
    block = max(varlen_extra(dims, Q, KV, 1.0, 0.5), varlen_extra(dims, Q, KV, 0.5, 1.0))
    steps = [f * Q + f * KV + KV * (2 if i + 1 < R else 1) + f * KV + (2 * f * KV if i >= 2 else 0.0) + block
             for i in range(1, R)]
    diagonal = f * Q + f * KV + 2 * KV + varlen_extra(dims, Q, KV, 1.0, 1.0)
    return max(diagonal, *steps)


def _exchange_backward(dims: Dims, Q: float, KV: float, samples: tuple) -> float:
    """``ring_exchange.exchange_backward`` (the balanced layout) on CUDA, from the plan's rows step by step
    (``RingBalance.steps``, shares of a rank's tokens; the mean over the mock samples of each one's largest moment).
    During block i: the fp32 dq accumulator and this rank's fp32 dk/dv, the rows in use, step i+1's received and
    sent copies, the block's fp32 dk/dv and step i-1's on their way back (sent, and this rank's coming back), and
    the block's variable-length calls; first the diagonal block's beside step 1's transfer. Example, 1M on a ring of
    8 with 64K documents: the worst step holds 1.7-3.9 ranks' worth of k/v rows, fp32 grads counted twice, where
    the zigzag's holds 7."""
    f = 4 / dims.compute_bytes
    base = f * Q + f * KV
    worst = [max(max(base + KV * (use + ahead) + f * KV * (use + back) + varlen_extra(dims, Q, KV, 1.0, use)
                     for use, ahead, back in steps),
                 base + KV * max(ahead for _, ahead, _ in steps) + varlen_extra(dims, Q, KV, 1.0, 1.0))
             for steps in samples]
    return sum(worst) / len(worst)


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
