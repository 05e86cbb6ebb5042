"""Core attention as an explicit (forward -> out, lse) / (backward from q, k, v, out, lse) pair.

Token-wise recompute (``recompute_granularity: full``) and Memo offload keep each layer's attention output and
what its backward needs, so attention is never computed twice (LightSeq's rematerialization-aware checkpointing).
That needs core attention without its own autograd graph:

    out, lse = io.forward(q, k, v)                    # q [s, b, nq, d], k/v [s, b, nkv, d] -> out [s, b, nq, d]
    dq, dk, dv = io.backward(dout, q, k, v, out, lse)  # same layouts; lse in whatever layout forward chose

Any core attention module can opt in by defining ``forward_with_lse(q, k, v)`` and
``backward_with_lse(dout, q, k, v, out, lse)`` with those signatures; ``LocalCausalAttention`` (cp = 1) is adapted
here through ``attention/backends.py``. Context-parallel modules (ring, Ulysses) are adapted in
``lse_attention`` when they are present.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn

from ..config import ConfigError


class LseAttention(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(self, dout, q, k, v, out, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def _bnsd(t: torch.Tensor) -> torch.Tensor:
    """[s, b, n, d] -> [b, n, s, d] as a view: the backends take strided inputs (torch's CPU flash kernels read
    strides; flash-attn / TE copy to their own layout), so no copy of q, k, v, out or dout is made here -- in the
    backward of a recomputed layer those copies were 3.5 hidden vectors a token next to the originals."""
    return t.permute(1, 2, 0, 3)


def _sbnd(t: torch.Tensor) -> torch.Tensor:
    """[b, n, s, d] -> [s, b, n, d]; no copy when the backend already laid it out that way (torch's CPU flash
    kernel writes out as [s, b, n, d] and dq/dk/dv as [b, s, n, d])."""
    return t.permute(2, 0, 1, 3).contiguous()


class LocalLse:
    """Causal attention on the whole local sequence through a backend of ``attention/backends.py``."""

    def __init__(self, backend_name: str = "auto"):
        self.backend_name = backend_name
        self._backends: dict = {}

    def backend(self, device: torch.device):
        from ..attention.backends import get_backend

        if device.type not in self._backends:
            name = "auto" if self.backend_name == "te" else self.backend_name
            self._backends[device.type] = get_backend(name, device)
        return self._backends[device.type]

    def forward(self, q, k, v):
        out, lse = self.backend(q.device).forward(_bnsd(q), _bnsd(k), _bnsd(v), True)
        return _sbnd(out), lse

    def backward(self, dout, q, k, v, out, lse):
        dq, dk, dv = self.backend(q.device).backward(_bnsd(dout), _bnsd(q), _bnsd(k), _bnsd(v), _bnsd(out), lse,
                                                     True)
        return _sbnd(dq), _sbnd(dk), _sbnd(dv)


class ModuleLse:
    """A core attention module that defines ``forward_with_lse`` / ``backward_with_lse`` itself."""

    def __init__(self, module: nn.Module):
        self.module = module

    def forward(self, q, k, v):
        return self.module.forward_with_lse(q, k, v)

    def backward(self, dout, q, k, v, out, lse):
        return self.module.backward_with_lse(dout, q, k, v, out, lse)


def lse_attention(core: nn.Module, backend_name: str = "auto", feature: str = "recompute") -> LseAttention:
    """The (out, lse) form of a layer's core attention module, or a ConfigError naming what is missing."""
    from ..attention.local import LocalCausalAttention

    if hasattr(core, "forward_with_lse") and hasattr(core, "backward_with_lse"):
        return ModuleLse(core)
    if isinstance(core, LocalCausalAttention):
        return LocalLse(backend_name)
    adapted = _adapt_context_parallel(core, backend_name)
    if adapted is not None:
        return adapted
    raise ConfigError(f"{feature} keeps the attention output and lse instead of recomputing attention, which needs "
                      f"core attention with forward_with_lse/backward_with_lse; {type(core).__name__} has neither")


def _adapt_context_parallel(core: nn.Module, backend_name: str) -> Optional[LseAttention]:
    """Ring / Ulysses modules of ``attention/`` (when that code is present), else None."""
    try:
        from . import attention_cp
    except ImportError:
        return None
    return attention_cp.adapt(core, backend_name)
