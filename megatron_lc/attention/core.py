"""The core-attention protocol: what every core attention of this package implements, and all that the memory
techniques (token-wise recompute, Memo offload) call.

Core attention maps this rank's q ``[s, b, nq, d]`` and k, v ``[s, b, nkv, d]`` (local heads after tp, local tokens
after cp, in the layout's token order) to the output ``[s, b, nq, d]``, causal over global positions::

    out = core(q, k, v, documents)                        # with autograd (the plain layer)
    out, lse = core.forward_with_lse(q, k, v, documents)  # no graph; lse fp32, its layout the implementation's own
    dq, dk, dv = core.backward_with_lse(dout, q, k, v, out, lse, documents)  # from that forward's merged out, lse

``documents``: None, or the full-sequence document ids ``[b, s]`` of packed documents (``masks.py``): a token then
sees only its own document, on every path.

The pair lets a layer keep the attention output and lse instead of recomputing attention (LightSeq's
rematerialization-aware checkpointing; Memo keeps them whole). Implementations:

    LocalCausalAttention   cp == 1, one kernel call                                     (local.py)
    RingAttention          ring over ``Axis.RING``, zigzag or balanced layout, blocks merged by lse (ring.py)
    UlyssesAttention       all-to-all over ``Axis.ULYSSES`` around an inner core attention: local (a2a) or
                           ring (a2a+p2p, the hybrid)                                   (ulysses.py)

FPDT is not a core attention: it owns the QKV and output projections of its chunks (``attention/fpdt/``), so it is
an attention *block* ``(x, rope) -> y`` built on the kernel level of this protocol (``backends.py``: forward with
lse, backward from a given lse, per chunk). Memory techniques wrap such a block whole.

All of them reach the local kernels through ``backends.Kernels``; ``backends.py`` documents the kernel interface
(``[b, n, s, d]`` tensors, ``causal`` for diagonal blocks).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn


def to_bnsd(t: torch.Tensor) -> torch.Tensor:
    """``[s, b, n, d]`` -> ``[b, n, s, d]`` as a view: the kernels take strided inputs (torch's CPU flash kernels read
    strides; flash-attn / TE copy to their own layout), so no copy of q, k, v, out or dout is made here -- in the
    backward of a recomputed layer those copies were 3.5 hidden vectors a token next to the originals."""
    return t.permute(1, 2, 0, 3)


def to_sbnd(t: torch.Tensor) -> torch.Tensor:
    """``[b, n, s, d]`` -> ``[s, b, n, d]``; no copy when the kernel already laid it out that way (torch's CPU flash
    kernel writes out as ``[s, b, n, d]`` and dq/dk/dv as ``[b, s, n, d]``)."""
    return t.permute(2, 0, 1, 3).contiguous()


class CoreAttention(nn.Module):
    """Base of the core attentions (see the module doc). Subclasses implement all three calls."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def forward_with_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         documents: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def backward_with_lse(self, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, documents: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError
