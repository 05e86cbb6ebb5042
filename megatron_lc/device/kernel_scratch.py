"""What CUDA's kernels allocate inside themselves: the workspaces and hidden copies of the ops a training step calls,
which no tensor of ours shows -- the outputs are ours, these are not. Each entry names the PyTorch (or cuDNN / NCCL)
source it is read from; the rehearsal adds them to its trace at the moment the op runs (``KernelScratch``, a
dispatch mode: every op on the accelerator, ``scratch(func, args)``), the estimator adds the same bytes by formula
(``flash_backward``, ``varlen_backward``, ... take shapes, not tensors: one home for each fact).

Example, the variable-length backward of 4M packed query rows, 4 query heads and 1 kv head of 128 (bf16)::

    varlen_backward(total_q=4 << 20, total_k=4 << 20, segments=64, nq=4, nkv=1, d=128, elem=2)
    # fp32 dq accumulator ((4M + 64 x 128) rows x 4 heads x 128 x 4 B = 8.01 GiB), its softmax sums (64 MiB),
    # dk and dv at the 4 query heads before the group sum (2 x 4 GiB): 16.08 GiB inside the kernel

Not charged (said where they would be): the caching allocator's rounding, CUDA's context and kernels' code, cuDNN's
GQA full-head dK / dV of some cudnn-frontend revisions, the memory-efficient kernel's split-key workspace (fp32
inputs need none), the embedding backward's partial sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

MIB = 1 << 20
# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize: ":4096:2:16:8 default, 32MiB for Hopper" -- one
# workspace per (handle, stream) for cuBLAS and one for cuBLASLt (cublas_ / cublaslt_handle_stream_to_workspace),
# allocated through the caching allocator at a stream's first matmul and kept
CUBLAS_WORKSPACE = 32 * MIB
# NCCL's buffers per communicator, made at its first collective outside the caching allocator: NCCL_BUFFSIZE (4 MiB,
# NCCL's environment documentation) for each direction of each channel; 16 channels assumed (NCCL picks them per
# topology: a lent GPU's measurement replaces this figure)
NCCL_BUFFSIZE = 4 * MIB
NCCL_CHANNELS = 16
NCCL_COMMUNICATOR = 2 * NCCL_CHANNELS * NCCL_BUFFSIZE


@dataclass(frozen=True)
class Scratch:
    """``nbytes`` a kernel holds while it runs (``kept``: allocated at its first call and held afterwards)."""

    what: str
    nbytes: int
    kept: bool = False


def _round(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _copy(t: torch.Tensor, what: str) -> list:
    """``t.contiguous()`` inside a kernel: a copy when ``t`` is not contiguous."""
    return [] if t.is_contiguous() else [Scratch(what, t.numel() * t.element_size())]


# ---- formulas, shared with the estimator: sizes in "row-heads" (a call's rows times its heads), bytes out --------
def flash_workspace(q_rowheads: float, d: int) -> list:
    """FlashAttention-2's backward inside PyTorch (aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp,
    ``mha_bwd`` / ``mha_varlen_bwd``): ``softmax_d`` fp32 ``[b, nq, rows]`` and ``dq_accum`` fp32 ``[b, rows, nq,
    round_up(d, 32)]`` (``loop = true`` always; not deterministic). ``rows``: the queries rounded up to 128 (dense)
    or ``total_q + 128 * segments`` (varlen)."""
    return [Scratch("flash backward: softmax_d (fp32)", int(q_rowheads * 4)),
            Scratch("flash backward: dq_accum (fp32)", int(q_rowheads * _round(d, 32) * 4))]


def gqa_expanded(k_rowheads: float, d: int, elem: int) -> list:
    """``mha_bwd`` / ``mha_varlen_bwd`` under GQA (fewer kv heads): ``dk_expanded``, ``dv_expanded`` at the query
    heads (``k_rowheads``: the call's key rows times its *query* heads) in the inputs' dtype, summed to the kv heads
    after the kernel (``at::sum_out``)."""
    return [Scratch("flash backward: dk, dv at the query heads (GQA)", int(2 * k_rowheads * d * elem))]


def flash_backward(b: int, sq: int, sk: int, nq: int, nkv: int, d: int, elem: int) -> list:
    """``aten._scaled_dot_product_flash_attention_backward`` on CUDA, beyond the copies of dout / out
    (``_flash_attention_backward`` in attention_backward.cu makes the ``[b, s, n, d]`` transposes contiguous)."""
    return flash_workspace(b * _round(sq, 128) * nq, d) + (gqa_expanded(b * sk * nq, d, elem) if nkv < nq else [])


def varlen_backward(total_q: int, total_k: int, segments: int, nq: int, nkv: int, d: int, elem: int) -> list:
    """``torch_attn::_varlen_attn_backward`` (torch/nn/attention/varlen.py -> ``aten._flash_attention_backward``
    with cumulative lengths -> ``mha_varlen_bwd``): rows ``total_q + 128 * segments`` (each segment 128 rows apart,
    flash_api.cpp's note on ``dq_accum``)."""
    return flash_workspace((total_q + 128 * segments) * nq, d) + (gqa_expanded(total_k * nq, d, elem)
                                                                   if nkv < nq else [])


def cudnn_workspace(q_rowheads: float, d: int) -> list:
    """cuDNN's SDPA backward (aten/src/ATen/native/cudnn/MHA.cpp ``run_cudnn_SDP_bprop``: the graph's workspace,
    ``get_workspace_size``): cudnn-frontend's SDPA backward node keeps ``dQ_accum`` fp32 ``[b, nq, sq, d]`` (cuDNN
    >= 9: no dP workspace) and ``softmax_sum`` fp32 ``[b, nq, sq]``."""
    return [Scratch("cuDNN backward: dQ_accum (fp32)", int(q_rowheads * d * 4)),
            Scratch("cuDNN backward: softmax_sum (fp32)", int(q_rowheads * 4))]


def efficient_workspace(q_rowheads: float) -> list:
    """``aten._efficient_attention_backward`` (attention_backward.cu): ``delta`` fp32 ``[b, nq, sq]`` (fp32 inputs
    need no gK / gV accumulation workspace), beyond the copy of ``grad_out`` made contiguous."""
    return [Scratch("memory-efficient backward: delta (fp32)", int(q_rowheads * 4))]


def index_put_accumulate(self_bytes: int, self_contiguous: bool, indices: int, value_copy: int = 0) -> list:
    """``index_put_(..., accumulate=True)`` on CUDA: ``index_put_with_sort_kernel`` (aten/src/ATen/native/cuda/
    Indexing.cu): ``self.contiguous()`` when ``self`` is not, copied back at the end (``self.copy_(self_)``); the
    linear index, its sorted copy, the original positions and ``arange`` (int64, one per index); ``value`` expanded
    to the indexed shape and made contiguous."""
    out = [Scratch("index_put_ accumulate: the sort's int64 indices", 4 * 8 * indices)]
    if not self_contiguous:
        out.append(Scratch("index_put_ accumulate: self made contiguous", self_bytes))
    if value_copy:
        out.append(Scratch("index_put_ accumulate: value made contiguous", value_copy))
    return out


def kept_workspaces(communicators: int) -> list:
    """What a CUDA run holds from its first matmul and its communicators' first collectives on (``KernelScratch``'s
    kept charges): cuBLAS's and cuBLASLt's workspaces on the compute stream, NCCL's buffers per communicator."""
    return [Scratch("cuBLAS workspace (compute stream)", CUBLAS_WORKSPACE, kept=True),
            Scratch("cuBLASLt workspace (compute stream)", CUBLAS_WORKSPACE, kept=True)] + \
        [Scratch("NCCL buffers of a communicator", NCCL_COMMUNICATOR, kept=True)] * communicators


def total(items: list) -> int:
    return sum(s.nbytes for s in items)


# ---- the table: an op's arguments -> what its CUDA kernel holds ----------------------------------------------------
def _bnsd(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _sdpa_flash_bwd(args, kwargs) -> list:
    dout, q, k, _v, out = args[:5]
    b, nq, sq, d = _bnsd(q)
    # _scaled_dot_product_flash_attention_backward_cuda transposes to [b, s, n, d]; _flash_attention_backward then
    # calls grad_out.contiguous() and out.contiguous() on those transposes
    copies = _copy(dout.transpose(1, 2), "flash backward: dout made contiguous") + \
        _copy(out.transpose(1, 2), "flash backward: out made contiguous")
    return copies + flash_backward(b, sq, k.shape[2], nq, k.shape[1], d, q.element_size())


def _varlen_bwd(args, kwargs) -> list:
    dout, q, k, _v, out, _lse, cu_q = args[:7]
    copies = _copy(dout, "varlen backward: dout made contiguous") + _copy(out, "varlen backward: out made contiguous")
    return copies + varlen_backward(q.shape[0], k.shape[0], cu_q.shape[0] - 1, q.shape[1], k.shape[1], q.shape[2],
                                    q.element_size())


def _cudnn_bwd(args, kwargs) -> list:
    _dout, q = args[:2]
    b, nq, sq, d = _bnsd(q)
    return cudnn_workspace(b * nq * sq, d)


def _efficient_bwd(args, kwargs) -> list:
    dout, q = args[:2]
    b, nq, sq, _ = _bnsd(q)
    return _copy(dout.transpose(1, 2), "memory-efficient backward: dout made contiguous") + \
        efficient_workspace(b * nq * sq)


def _index_put(args, kwargs) -> list:
    self, indices, values = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if not accumulate:
        return []  # (the TensorIterator kernel writes through strides; only deterministic mode sorts)
    idx = [i for i in indices if i is not None]
    n = math.prod(torch.broadcast_shapes(*(i.shape for i in idx))) if idx else 0
    indexed = math.prod(self.shape[d] for d, i in enumerate(indices) if i is not None)
    expanded = n * (self.numel() // max(indexed, 1))  # the value expanded to the indexed result's shape
    value_copy = 0 if values.is_contiguous() and values.numel() == expanded else expanded * values.element_size()
    return index_put_accumulate(self.numel() * self.element_size(), self.is_contiguous(), n, value_copy)


_OPS: dict = {"aten::_scaled_dot_product_flash_attention_backward": _sdpa_flash_bwd,
              "torch_attn::_varlen_attn_backward": _varlen_bwd,
              "aten::_scaled_dot_product_cudnn_attention_backward": _cudnn_bwd,
              "aten::_scaled_dot_product_efficient_attention_backward": _efficient_bwd,
              "aten::index_put_": _index_put, "aten::_index_put_impl_": _index_put}
_MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm", "aten::matmul"}
_COLLECTIVES = "c10d::"


def scratch(func, args, kwargs) -> list:
    """What ``func``'s CUDA kernel holds inside itself for these arguments (``[]``: nothing we know of)."""
    fn = _OPS.get(func._schema.name)
    return fn(args, kwargs or {}) if fn is not None else []


def _group(args) -> Optional[tuple]:
    """(name, size) of the process group a c10d op runs on (its first ``ProcessGroup`` argument)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except RuntimeError:  # a ReduceOp, a Work
                continue
            return pg.group_name, pg.size()
    return None


def _on(device: torch.device, args) -> bool:
    """Whether the op's tensors are on ``device``'s type (the accelerator's kernels, not the host's)."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor):
            return a.device.type == device.type
    return False


class KernelScratch(TorchDispatchMode):
    """Hands ``charge(func, items)`` what each op on ``device`` holds inside its CUDA kernel while it runs (after the
    op, so its outputs are counted beside): the table above, cuBLAS's workspaces at the first matmul (kept), NCCL's
    buffers at a communicator's first collective (kept, once per process group)."""

    def __init__(self, device: torch.device, charge: Callable[[object, list], None]):
        super().__init__()
        self.device, self.charge = device, charge
        self.matmul_seen = False
        self.groups: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if not _on(self.device, (args, kwargs)):
            return out
        items = scratch(func, args, kwargs)
        if name in _MATMULS and not self.matmul_seen:
            self.matmul_seen = True
            items = items + kept_workspaces(0)
        if name.startswith(_COLLECTIVES):
            group = _group(args)
            if group is not None and group[1] > 1 and group[0] not in self.groups:
                self.groups.add(group[0])
                items = items + [Scratch(f"NCCL buffers of communicator {group[0]} ({group[1]} ranks)",
                                         NCCL_COMMUNICATOR, kept=True)]
        if items:
            self.charge(func, items)
        return out
