"""Local (single-rank) causal attention, used when cp == 1. q/k/v ``[s, b, n, d]`` (k/v may have fewer heads: GQA)
-> ``[s, b, nq, d]``. Under document masks or a sliding window the sequence is one block of rectangles
(``ranges.py``): 3 documents are 3 causal kernel calls, a window W over s tokens about 2s/W calls of W x W.

The plain forward is ``F.scaled_dot_product_attention`` only where SDPA's own choice is the backend's kernel with
k, v as they are: PyTorch's fused kernels in bf16 / fp16 (flash takes fewer kv heads) or without GQA, and on CPU.
Otherwise it is the backend's (out, lse) kernel under autograd: a named cuDNN / FlashAttention-3 / 4 / flash-attn /
TE / math kernel, and fp32 with GQA on CUDA, where SDPA would run its math kernel (the memory-efficient one takes no
fewer kv heads) with an s x s score matrix per head -- the kernel path repeats k, v for the call instead."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..config.documents import DocumentRanges
from .backends import Kernels, TorchCPUBackend
from .core import CoreAttention, to_bnsd, to_sbnd
from .fused_cuda import TorchCUDABackend
from .ranges import block_rects


class _KernelAttention(torch.autograd.Function):
    """Causal attention of ``[b, n, s, d]`` tensors (``rects`` None) or over a block's rectangles, through the
    (out, lse) kernels and their backward."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, rects):
        out, lse = kernel.forward(q, k, v, True) if rects is None else kernel.forward_rects(q, k, v, rects)
        out = out.to(q.dtype)
        ctx.kernel, ctx.rects = kernel, rects
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if ctx.rects is None:
            dq, dk, dv = ctx.kernel.backward(dout, q, k, v, out, lse, True)
        else:
            dq, dk, dv = ctx.kernel.backward_rects(dout, q, k, v, out, lse, ctx.rects)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def sdpa_is_the_kernel(kernel, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether ``F.scaled_dot_product_attention`` runs ``kernel``'s own kernel on k, v as they are (module doc)."""
    if type(kernel) is TorchCPUBackend:
        return True
    return type(kernel) is TorchCUDABackend and (q.dtype in (torch.float16, torch.bfloat16) or k.shape[1] == q.shape[1])


class LocalCausalAttention(CoreAttention):
    """The plain forward is torch SDPA on the whole local sequence where that is the backend's kernel
    (``sdpa_is_the_kernel``); the (out, lse) pair, and every call under documents or a window, go through
    ``parallel.attention_backend``'s kernel. ``window``: the layer's causal sliding window in tokens (None: every
    earlier token)."""

    def __init__(self, backend="auto", window: Optional[int] = None):  # a parallel.attention_backend name or Kernels
        super().__init__()
        self.kernels = Kernels.of(backend)
        self.window = window

    def rects(self, documents: Optional[DocumentRanges], s: int):
        """The whole local sequence as one block (None: plain causal)."""
        whole = ((0, s, 0),)
        return block_rects(documents, self.window, whole, whole)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        rects, kernel = self.rects(documents, q.shape[0]), self.kernels(q.device)
        if rects is None and sdpa_is_the_kernel(kernel, q_, k_):
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=k_.shape[1] != q_.shape[1])
        else:
            out = _KernelAttention.apply(q_, k_, v_, kernel, rects)
        return out.permute(2, 0, 1, 3)

    def forward_with_lse(self, q, k, v, documents=None):
        rects, kernel = self.rects(documents, q.shape[0]), self.kernels(q.device)
        if rects is None:
            out, lse = kernel.forward(to_bnsd(q), to_bnsd(k), to_bnsd(v), True)
        else:
            out, lse = kernel.forward_rects(to_bnsd(q), to_bnsd(k), to_bnsd(v), rects)
        return to_sbnd(out.to(q.dtype)), lse

    def backward_with_lse(self, dout, q, k, v, out, lse, documents=None):
        rects, kernel = self.rects(documents, q.shape[0]), self.kernels(q.device)
        args = (to_bnsd(dout), to_bnsd(q), to_bnsd(k), to_bnsd(v), to_bnsd(out), lse)
        if rects is None:
            dq, dk, dv = kernel.backward(*args, True)
        else:
            dq, dk, dv = (g.to(t.dtype) for g, t in zip(kernel.backward_rects(*args, rects), (q, k, v)))
        return to_sbnd(dq), to_sbnd(dk), to_sbnd(dv)
