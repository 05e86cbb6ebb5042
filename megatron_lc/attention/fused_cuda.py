"""PyTorch's own fused attention kernels on CUDA, behind the (out, lse) interface of ``backends.py`` -- what a stock
PyTorch install has: no flash-attn, no TransformerEngine.

* bf16 / fp16, head dim <= 256: ``aten._scaled_dot_product_flash_attention`` and its backward (FlashAttention-2
  inside PyTorch; lse ``[b, n, sq]`` fp32). GQA native: k, v keep their kv heads (SDPA's own check lets flash take
  them, ``check_batch_size_and_num_heads_dense<true /*supports GQA*/>`` in sdp_utils.cpp; ``mha_fwd`` / ``mha_bwd``
  take ``num_heads_k`` dividing ``num_heads``, the backward sums dk, dv over each group itself).
* fp32 or larger heads: ``aten._scaled_dot_product_efficient_attention`` (the memory-efficient kernel; its lse is
  ``[b, n, round_up(sq, 32)]`` -- sliced to ``sq`` here and padded back for its backward). It takes no GQA
  (``_efficient_attention_backward`` checks ``query.size(2) == key.size(2)``): k, v repeated to the query heads for
  the call and dk, dv summed back over each group (the memory of one repeated block, not of the sequence).
* Rectangles of document masks and windows (``ranges.py``), bf16 / fp16: the variable-length kernel of
  ``torch.nn.attention.varlen`` (flash's: fp32 rectangles go one by one to the memory-efficient kernel,
  ``piecewise.py``) -- its custom ops ``torch_attn::_varlen_attn`` (out and lse ``[n, total_q]``) and
  ``torch_attn::_varlen_attn_backward``, which takes the out and lse it is given (``varlen_attn``'s autograd only
  passes its own; the op itself is what the ring's merged backward calls). Both have fake-tensor kernels, so a
  rehearsal runs their shapes. The rectangles of a block are packed by kind: FULL ones in calls with
  ``is_causal=False``, CAUSAL ones and the ANTI ones with their rows listed in reverse (then causal) in calls with
  ``is_causal=True``, each call of at most ``MAX_CALL_ROWS`` rows; each rectangle is one ``cu_seq`` segment, its rows gathered from the block's q, k, v by index
  (``[total, n, d]``, GQA native: no repeat). A forward call's query rows must be distinct (the merge writes them
  back), so a kind whose rectangles share query rows (a query span against two key spans) takes one call per layer
  of disjoint rectangles. The backward adds every call's dq, dk, dv into the fp32 accumulators with ``index_add_``
  along the sequence of each batch row's ``[n, s, d]`` slice: a strided write, no copy of the accumulator (CUDA's
  ``index_put_(accumulate=True)`` -- ``index_put_with_sort_kernel`` in aten/src/ATen/native/cuda/Indexing.cu --
  makes a non-contiguous target contiguous first and copies it back: a whole fp32 dq, dk, dv per call). The
  indices are built on the host (numpy) and copied from pinned memory without blocking: no host sync.

The flash and memory-efficient backwards take the out and lse they are given -- the *merged* ones of ring / FPDT
blocks, as the protocol needs. dout is passed as the caller's view: the kernel makes its ``[b, s, n, d]`` transpose
contiguous itself (``_flash_attention_backward``: ``grad_out.contiguous()``), which copies nothing for the cores'
``[s, b, n, d]`` tensors at batch 1 -- a ``dout.contiguous()`` here would be a ``[b, n, s, d]`` copy the kernel then
copies again. What the kernels allocate inside themselves (FlashAttention-2's fp32 dq accumulator, GQA's dk, dv at
the query heads, ...) is ``device/kernel_scratch.py``'s table, which the rehearsal and the estimator both count.
Dropout is 0, so the kernels' RNG arguments are never read (``rng_placeholders``).

Never executed on this project's CPU machines: the wrapping (GQA, lse padding, the varlen packing, reversal and
merge) is tested on CPU with stand-in kernels of the same signatures and constraints
(tests/attention/test_attention_backends.py, tests/attention/test_ranges.py); ``scripts/gpu_check.sh`` is where the
kernels themselves are checked.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.attention.varlen  # noqa: F401  (registers torch.ops.torch_attn: the variable-length kernel)

from .merge import merge_into
from .piecewise import empty_result, rects_backward, rects_forward
from .ranges import ANTI, FULL

LSE_PAD = 32  # the memory-efficient kernel pads its lse rows to a multiple of this


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def rng_placeholders(q: torch.Tensor, flash: bool = True) -> tuple:
    """The backwards' RNG seed and offset, in the forms the forwards return them (flash: a ``[2]`` uint64 state and a
    0-dim uint64, flash_api.cpp ``mha_fwd``'s ``rng_state`` / ``_unused``; the memory-efficient kernel: 0-dim int64,
    ``seed_t`` / ``offset_t``). Dropout is 0, so no kernel reads them:
    ``mha_bwd`` / ``mha_varlen_bwd`` set ``params.rng_state`` only ``if (is_dropout)``, the memory-efficient backward
    reads ``philox_seed`` only ``if (use_dropout)`` (attention_backward.cu), cuDNN builds its seed / offset tensors
    only when ``dropout_probability != 0``."""
    if not flash:
        return tuple(torch.zeros((), dtype=torch.int64, device=q.device) for _ in range(2))
    return (torch.zeros(2, dtype=torch.uint64, device=q.device), torch.zeros((), dtype=torch.uint64, device=q.device))


def _index(dev: torch.device, values: np.ndarray) -> torch.Tensor:
    """A host index array on ``dev``; on CUDA from pinned memory without blocking (no stream sync)."""
    t = torch.from_numpy(values)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


class _Call:
    """One varlen call: the rows of its segments (batch row and position of each packed query and key), the
    segments' offsets and, per batch row, its packed rows (``row_spans``: ``(row, q0, q1, k0, k1)``; the rectangles
    come sorted by batch row). ``calls(rects)`` groups a block's rectangles into calls."""

    def __init__(self, causal: bool, rects: list):
        self.causal = causal
        q = [(r.row or 0, np.arange(r.q0, r.q1)[::-1] if r.kind == ANTI else np.arange(r.q0, r.q1)) for r in rects]
        k = [(r.row or 0, np.arange(r.k0, r.k1)[::-1] if r.kind == ANTI else np.arange(r.k0, r.k1)) for r in rects]
        self.q_rows, self.q_pos = (np.concatenate([np.full(len(p), b) for b, p in q]),
                                   np.concatenate([p for _, p in q]))
        self.k_rows, self.k_pos = (np.concatenate([np.full(len(p), b) for b, p in k]),
                                   np.concatenate([p for _, p in k]))
        lq, lk = [r.q1 - r.q0 for r in rects], [r.k1 - r.k0 for r in rects]
        self.cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
        self.cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
        self.max_q, self.max_k = max(lq), max(lk)
        rows = [r.row or 0 for r in rects]
        starts = [i for i in range(len(rects)) if i == 0 or rows[i] != rows[i - 1]] + [len(rects)]
        self.row_spans = [(rows[a], int(self.cu_q[a]), int(self.cu_q[b]), int(self.cu_k[a]), int(self.cu_k[b]))
                          for a, b in zip(starts[:-1], starts[1:])]

    def on(self, dev: torch.device):
        """Device index tensors: (q rows, q positions, k rows, k positions, cu_q, cu_k)."""
        return [_index(dev, a) for a in (self.q_rows, self.q_pos, self.k_rows, self.k_pos, self.cu_q, self.cu_k)]


# A call's packed rows, of its queries and of its keys, at most (a larger rectangle is a call of its own): what a
# call gathers and what the kernel holds inside itself (FlashAttention-2's fp32 dq accumulator, GQA's dk, dv at the
# query heads: device/kernel_scratch.py) grow with its rows, not its work. Ulysses at 4M with documents (4 query
# heads, 1 kv head of 128 a rank): one backward call over all 4M rows held 16 GiB inside the kernel and 20 GiB of
# packed tensors; eight calls of 512K rows hold 2 and 2.5.
MAX_CALL_ROWS = 1 << 19


def _bounded(rects: list) -> list:
    """``rects`` in runs whose query rows and key rows each stay within ``MAX_CALL_ROWS``."""
    runs, rows_q, rows_k = [[]], 0, 0
    for r in rects:
        lq, lk = r.q1 - r.q0, r.k1 - r.k0
        if runs[-1] and (rows_q + lq > MAX_CALL_ROWS or rows_k + lk > MAX_CALL_ROWS):
            runs.append([])
            rows_q = rows_k = 0
        runs[-1].append(r)
        rows_q, rows_k = rows_q + lq, rows_k + lk
    return runs if runs[0] else []


def calls(rects, forward: bool) -> list[_Call]:
    """The varlen calls of ``rects`` (each with its batch row: ``_per_row``), see the module doc: per kind in
    backward (its grads are added per batch row, ``index_add_``); in forward per layer of a kind's rectangles with
    disjoint query rows -- by start, each to the first layer whose rows of its batch row end before it (interval
    colouring: as few layers as rectangles overlap at a row, 2 for a query span against two key spans). Either way
    cut into calls of at most ``MAX_CALL_ROWS`` rows (``_bounded``), each with its rectangles in batch-row order."""
    if not forward:
        by_kind: dict = {}
        for r in sorted(rects, key=lambda r: r.row or 0):
            by_kind.setdefault(r.kind != FULL, []).append(r)
        return [_Call(causal, run) for causal, rs in sorted(by_kind.items()) for run in _bounded(rs)]
    layers: dict = {}  # causal -> [(rectangles, {batch row: end of its last query rows})]
    for r in sorted(rects, key=lambda r: (r.row or 0, r.q0)):
        kind = layers.setdefault(r.kind != FULL, [])
        for layer, ends in kind:
            if ends.get(r.row, 0) <= r.q0:
                layer.append(r)
                ends[r.row] = r.q1
                break
        else:
            kind.append(([r], {r.row: r.q1}))
    return [_Call(causal, run) for causal, kind in sorted(layers.items()) for layer, _ in kind
            for run in _bounded(layer)]


def packed_calls(rects, b: int, forward: bool) -> list[_Call]:
    """``calls`` of a block's rectangles for ``b`` batch rows, made once per block (kept on the ``ranges.Rects``)."""
    key = (b, forward)
    cache = getattr(rects, "packed", None)
    if cache is not None and key in cache:
        return cache[key]
    out = calls(_per_row(rects, b), forward)
    if cache is not None:
        cache[key] = out
    return out


def _per_row(rects, b: int) -> list:
    """Rectangles of every row (``row`` None: no documents) spelled out per batch row."""
    return [r._replace(row=i) for r in rects for i in range(b)] if rects and rects[0].row is None and b > 1 \
        else list(rects)


class TorchCUDABackend:
    name = "torch"

    def __init__(self, ops=None, varlen=None):
        self.ops = ops if ops is not None else torch.ops.aten  # tests pass CPU stand-ins of the kernels
        self.varlen = varlen if varlen is not None else torch.ops.torch_attn

    @staticmethod
    def _uses_flash(q: torch.Tensor) -> bool:
        return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256

    def _uses_varlen(self, q: torch.Tensor) -> bool:
        """The variable-length kernel is flash's (bf16 / fp16, head dim <= 256); otherwise the rectangles go one by
        one through ``forward`` / ``backward`` (``piecewise.py``: the memory-efficient kernel, no mask)."""
        return self._uses_flash(q)

    @staticmethod
    def _repeat(k: torch.Tensor, v: torch.Tensor, nq: int):
        """k, v at the query heads, for the memory-efficient kernel (it takes no GQA)."""
        if k.shape[1] == nq:
            return k, v
        r = nq // k.shape[1]
        return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)

    @staticmethod
    def _sum_groups(g: torch.Tensor, nkv: int) -> torch.Tensor:
        b, nq, s, d = g.shape
        return g if nq == nkv else g.view(b, nkv, nq // nkv, s, d).sum(2)

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None):
        if self._uses_flash(q):
            return self._low_precision_forward(q, k, v, causal, scale)
        ke, ve = self._repeat(k, v, q.shape[1])
        out, lse, _, _ = self.ops._scaled_dot_product_efficient_attention(q, ke, ve, None, True, 0.0, causal,
                                                                           scale=scale)
        return out, lse[..., :q.shape[2]].float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None):
        if self._uses_flash(q):
            return self._low_precision_backward(dout, q, k, v, out, lse.float().contiguous(), causal, scale)
        b, nq, sq, d = q.shape
        nkv = k.shape[1]
        ke, ve = self._repeat(k, v, nq)
        lse_p = torch.zeros(b, nq, _round_up(sq, LSE_PAD), dtype=torch.float32, device=q.device)
        lse_p[..., :sq] = lse
        dq, dk, dv, _ = self.ops._scaled_dot_product_efficient_attention_backward(
            dout, q, ke, ve, None, out, lse_p, *rng_placeholders(q, flash=False), 0.0, [True, True, True, False],
            causal, scale=scale)  # (dout as given: the kernel makes its transpose contiguous itself)
        return dq, self._sum_groups(dk, nkv), self._sum_groups(dv, nkv)

    # ---- bf16 / fp16: the dense kernel of this backend (subclasses: cuDNN's, FlashAttention-3 / 4's) ----------
    def _low_precision_forward(self, q, k, v, causal: bool, scale: Optional[float]):
        res = self.ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()

    def _low_precision_backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float]):
        return tuple(self.ops._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, *rng_placeholders(q),
            scale=scale))

    # ---- rectangles: the variable-length kernel -------------------------------------------------------------
    @staticmethod
    def _packed(idx, q, k, v):
        """A call's packed q, k, v ``[total, n, d]``, gathered from ``[b, n, s, d]`` by (row, position)."""
        qr, qp, kr, kp = idx[:4]
        return q.transpose(1, 2)[qr, qp], k.transpose(1, 2)[kr, kp], v.transpose(1, 2)[kr, kp]

    def forward_rects(self, q, k, v, rects, scale: Optional[float] = None, acc=None):
        """Every call's out merged by lse into ``acc`` (fp32 ``[b, nq, s, d]``, ``[b, nq, s]``; in place) at its
        query rows, which are distinct within a call."""
        if not self._uses_varlen(q):
            return rects_forward(self, q, k, v, rects, scale, acc)
        out, lse = acc if acc is not None else empty_result(q)
        out_t, lse_t = out.transpose(1, 2), lse.transpose(1, 2)  # [b, s, n, d], [b, s, n] views
        for call in packed_calls(rects, q.shape[0], forward=True):
            idx = call.on(q.device)
            qp, kp, vp = self._packed(idx, q, k, v)
            # the op's first ten arguments, the same in every torch that has it (2.11 has no enable_gqa and later
            # ones: the flash kernel under it takes fewer kv heads either way)
            o, l, _ = self.varlen._varlen_attn(qp, kp, vp, idx[4], idx[5], call.max_q, call.max_k, call.causal,
                                              scale, [-1, -1])
            del qp, kp, vp
            rows = (idx[0], idx[1])
            acc_out, acc_lse = out_t[rows], lse_t[rows]  # the call's rows gathered: [T, n, d], [T, n] fp32
            merge_into(acc_out, acc_lse, o, l.t())
            del o, l
            out_t.index_put_(rows, acc_out)
            lse_t.index_put_(rows, acc_lse)
            del acc_out, acc_lse
        return out, lse

    def backward_rects(self, dout, q, k, v, out, lse, rects, scale: Optional[float] = None, grads=None):
        """dq, dk, dv (fp32) of the rectangles from the merged ``out``, ``lse``, added into ``grads``."""
        if not self._uses_varlen(q):
            return rects_backward(self, dout, q, k, v, out, lse, rects, scale, grads)
        if grads is None:
            grads = (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                     torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                     torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        rng = rng_placeholders(q)[0]
        for call in packed_calls(rects, q.shape[0], forward=False):
            idx = call.on(q.device)
            qp, kp, vp = self._packed(idx, q, k, v)
            rows = (idx[0], idx[1])
            do_p, o_p = dout.transpose(1, 2)[rows], out.transpose(1, 2)[rows]
            l_p = lse.transpose(1, 2)[rows].t().contiguous().float()  # [n, T]
            gq, gk, gv = self.varlen._varlen_attn_backward(do_p, qp, kp, vp, o_p, l_p, idx[4], idx[5], call.max_q,
                                                           call.max_k, call.causal, rng, scale, [-1, -1])
            del qp, kp, vp, do_p, o_p, l_p
            _add_rows(grads[0], gq, idx[1], [(r, a, b) for r, a, b, _, _ in call.row_spans])
            del gq
            for acc, g in zip(grads[1:], (gk, gv)):
                _add_rows(acc, g, idx[3], [(r, a, b) for r, _, _, a, b in call.row_spans])
            del gk, gv
        return grads


def _add_rows(acc: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor, spans: list) -> None:
    """``acc[row, :, positions[a:b]] += packed[a:b]`` for each ``(row, a, b)``: ``acc`` fp32 ``[b, n, s, d]``,
    ``packed`` ``[T, n, d]`` (a call's grads, cast to fp32 one at a time). ``index_add_`` along the sequence dim of
    the row's ``[n, s, d]`` slice writes through its strides (``index_add_cuda_impl``: no copy of ``acc``); repeated
    positions (a query span against two key spans) add up."""
    src = packed.float()
    for row, a, b in spans:
        acc[row].index_add_(1, positions[a:b], src[a:b].transpose(0, 1))
