"""MLP: gated (SwiGLU: Llama, Qwen, Mistral; GeGLU with tanh GELU: Gemma) or plain GeLU (GPT). Token-wise: every
output token depends only on its input token.

The activation is one of ``ACTIVATIONS`` by ``activation_kind(cfg)``: its forward and its forward with a gradient
function, shared with MsT's chunked MLP (``memory/mst/mlp_function.py``), so the two compute the same numbers."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig


def _silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def _silu_backward(da: torch.Tensor, x: torch.Tensor, out=None) -> torch.Tensor:
    if out is None:
        return torch.ops.aten.silu_backward(da, x)
    return torch.ops.aten.silu_backward.grad_input(da, x, grad_input=out)


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _gelu_backward(da: torch.Tensor, x: torch.Tensor, out=None) -> torch.Tensor:
    if out is None:
        return torch.ops.aten.gelu_backward(da, x, approximate="tanh")
    return torch.ops.aten.gelu_backward.grad_input(da, x, approximate="tanh", grad_input=out)


# kind -> (gated, the nonlinearity, its backward (d out, input, out=None) -> d input, written into ``out`` if given)
ACTIVATIONS = {"swiglu": (True, _silu, _silu_backward), "geglu": (True, _gelu, _gelu_backward),
               "gelu": (False, _gelu, _gelu_backward)}


def activation_kind(cfg: ModelConfig) -> str:
    """``swiglu`` (gated, SiLU), ``geglu`` (``swiglu: false, gated_linear_unit: true``: gated, tanh GELU) or
    ``gelu`` (plain, tanh GELU)."""
    if not cfg.gated_linear_unit:
        return "gelu"
    return "swiglu" if cfg.swiglu else "geglu"


def activate(h: torch.Tensor, kind: str) -> torch.Tensor:
    """``act(gate) * up`` of fc1's output ``[..., gate; up]`` (gated kinds), or ``act(h)``."""
    gated, fn, _ = ACTIVATIONS[kind]
    if not gated:
        return fn(h)
    gate, up = h.chunk(2, dim=-1)
    return fn(gate) * up


def activate_with_grad_fn(h: torch.Tensor, kind: str) -> tuple[torch.Tensor, Callable]:
    """``activate(h, kind)`` and a function mapping d(loss)/d(act) to d(loss)/dh (the gate's nonlinearity computed
    once, dh written into one buffer: no concatenation)."""
    gated, fn, backward = ACTIVATIONS[kind]
    if not gated:
        return fn(h), lambda da: backward(da, h)
    gate, up = h.chunk(2, dim=-1)
    a = fn(gate)

    def grad_fn(da: torch.Tensor) -> torch.Tensor:
        dh = torch.empty_like(h)
        d_gate, d_up = dh.chunk(2, dim=-1)
        torch.mul(da, a, out=d_up)
        backward(da * up, gate, out=d_gate)
        return dh

    return a * up, grad_fn


class MLP(nn.Module):
    """``fc1`` is column parallel (for a gated MLP its full weight is ``[gate; up]``, ``stride=2`` so each tp rank
    holds its slice of both), ``fc2`` row parallel."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__()
        self.kind = activation_kind(cfg)
        gated = ACTIVATIONS[self.kind][0]
        f = cfg.ffn_hidden_size
        self.linear_fc1 = parts.column_linear(cfg.hidden_size, 2 * f if gated else f, bias=cfg.add_bias_linear,
                                              stride=2 if gated else 1, std=cfg.init_method_std)
        self.linear_fc2 = parts.row_linear(f, cfg.hidden_size, bias=cfg.add_bias_linear, std=output_std)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        return activate(x, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))
