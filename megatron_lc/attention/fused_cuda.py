"""PyTorch's own fused attention kernels on CUDA, behind the (out, lse) interface of ``backends.py`` -- what a stock
PyTorch install has: no flash-attn, no TransformerEngine.

* bf16 / fp16, head dim <= 256, no document mask: ``aten._scaled_dot_product_flash_attention`` and its backward
  (FlashAttention-2 inside PyTorch; lse ``[b, n, sq]`` fp32).
* fp32, larger heads, or a document mask: ``aten._scaled_dot_product_efficient_attention`` (the memory-efficient
  kernel: an additive bias for the mask; its lse is ``[b, n, round_up(sq, 32)]`` -- sliced to ``sq`` here and padded
  back for its backward).

Both backwards take the out and lse they are given -- the *merged* ones of ring / FPDT blocks, as the protocol
needs. Neither kernel takes fewer kv heads than query heads: k and v are repeated to nq heads for the kernel and
dk, dv summed back over each group (the memory of one repeated block, not of the sequence). Dropout is 0, so the
kernels' RNG arguments are unused (placeholders are passed).

Never executed on this project's CPU machines: the wrapping (GQA repeat and sum, lse padding, bias layout, rows
that see no key) is tested on CPU with stand-in kernels of the same signatures
(tests/attention/test_attention_backends.py);
``scripts/gpu_check.sh`` T1 is where the kernels themselves are checked.
"""
from __future__ import annotations

from typing import Optional

import torch

from .masks import with_causal

LSE_PAD = 32  # the memory-efficient kernel pads its lse rows to a multiple of this
BIAS_ALIGN = 16  # its bias needs a 16-element aligned row stride (as SDPA pads masks)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _additive_bias(visible: torch.Tensor, causal: bool, nq: int, dtype: torch.dtype) -> torch.Tensor:
    """``visible [b, 1, sq, sk]`` (and the causal triangle) -> 0 / -inf bias ``[b, nq, sq, sk]`` of ``dtype``: a
    view of a ``[b, 1, sq, round_up(sk, 16)]`` buffer, broadcast over heads."""
    vis = with_causal(visible, causal)
    b, _, sq, sk = vis.shape
    buf = torch.zeros(b, 1, sq, _round_up(sk, BIAS_ALIGN), dtype=dtype, device=vis.device)
    bias = buf[..., :sk]
    bias.masked_fill_(~vis, float("-inf"))
    return bias.expand(b, nq, sq, sk)


class TorchCUDABackend:
    name = "torch"

    def __init__(self, ops=None):
        self.ops = ops if ops is not None else torch.ops.aten  # tests pass CPU stand-ins of the two kernels

    @staticmethod
    def _uses_flash(q: torch.Tensor, visible) -> bool:
        return visible is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256

    @staticmethod
    def _repeat(k: torch.Tensor, v: torch.Tensor, nq: int):
        if k.shape[1] == nq:
            return k, v
        r = nq // k.shape[1]
        return k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)

    @staticmethod
    def _sum_groups(g: torch.Tensor, nkv: int) -> torch.Tensor:
        b, nq, s, d = g.shape
        return g if nq == nkv else g.view(b, nkv, nq // nkv, s, d).sum(2)

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None, visible=None):
        sq = q.shape[2]
        ke, ve = self._repeat(k, v, q.shape[1])
        if self._uses_flash(q, visible):
            res = self.ops._scaled_dot_product_flash_attention(q, ke, ve, 0.0, causal, False, scale=scale)
            return res[0], res[1].float()
        bias = None if visible is None else _additive_bias(visible, causal, q.shape[1], q.dtype)
        out, lse, _, _ = self.ops._scaled_dot_product_efficient_attention(
            q, ke, ve, bias, True, 0.0, causal and bias is None, scale=scale)
        lse = lse[..., :sq].float()
        if visible is not None:  # rows that see no key: out 0, lse -inf (the merge ignores them)
            blind = ~with_causal(visible, causal).any(-1)  # [b, 1, sq]
            if bool(blind.any()):
                out = out.masked_fill(blind.unsqueeze(-1), 0.0)
                lse = lse.masked_fill(blind, float("-inf"))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None, visible=None):
        b, nq, sq, d = q.shape
        nkv = k.shape[1]
        ke, ve = self._repeat(k, v, nq)
        lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).float().contiguous()
        placeholder = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: RNG state unused
        if self._uses_flash(q, visible):
            dq, dk, dv = self.ops._scaled_dot_product_flash_attention_backward(
                dout.contiguous(), q, ke, ve, out, lse, None, None, sq, ke.shape[2], 0.0, causal, placeholder,
                placeholder, scale=scale)
        else:
            bias = None if visible is None else _additive_bias(visible, causal, nq, q.dtype)
            lse_p = torch.zeros(b, nq, _round_up(sq, LSE_PAD), dtype=torch.float32, device=q.device)
            lse_p[..., :sq] = lse
            dq, dk, dv, _ = self.ops._scaled_dot_product_efficient_attention_backward(
                dout.contiguous(), q, ke, ve, bias, out, lse_p, placeholder, placeholder, 0.0,
                [True, True, True, False], causal and bias is None, scale=scale)
        return dq, self._sum_groups(dk, nkv), self._sum_groups(dv, nkv)

