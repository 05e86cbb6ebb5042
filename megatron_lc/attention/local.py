"""Local (single-rank) causal attention, used when cp == 1. q/k/v ``[s, b, n, d]`` (k/v may have fewer heads: GQA)
-> ``[s, b, nq, d]``."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backends import Kernels
from .core import CoreAttention, to_bnsd, to_sbnd
from .masks import visible, with_causal


class LocalCausalAttention(CoreAttention):
    """The plain forward is torch SDPA on the whole local sequence (its best kernel for the device); the (out, lse)
    pair goes through ``parallel.attention_backend``'s kernel."""

    def __init__(self, backend="auto"):  # a parallel.attention_backend name or the model's Kernels
        super().__init__()
        self.kernels = Kernels.of(backend)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        q_, k_, v_ = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        gqa = k_.shape[1] != q_.shape[1]
        if documents is None:
            out = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=gqa)
        else:  # the whole sequence is local: the ids are in order
            mask = with_causal(visible(documents, documents), True)
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=mask, enable_gqa=gqa)
        return out.permute(2, 0, 1, 3)

    def forward_with_lse(self, q, k, v, documents=None):
        vis = None if documents is None else visible(documents, documents)
        out, lse = self.kernels(q.device).forward(to_bnsd(q), to_bnsd(k), to_bnsd(v), True, visible=vis)
        return to_sbnd(out), lse

    def backward_with_lse(self, dout, q, k, v, out, lse, documents=None):
        vis = None if documents is None else visible(documents, documents)
        dq, dk, dv = self.kernels(q.device).backward(to_bnsd(dout), to_bnsd(q), to_bnsd(k), to_bnsd(v), to_bnsd(out),
                                                      lse, True, visible=vis)
        return to_sbnd(dq), to_sbnd(dk), to_sbnd(dv)
