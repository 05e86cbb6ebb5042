"""The autocast state of a forward, re-entered when that forward runs again for its backward, as
``torch.utils.checkpoint`` does: with ``train.bf16`` the step's forward runs under ``torch.autocast("cuda",
bfloat16)`` and autograd runs the backward outside that context, so a re-run without it would compute in fp32 --
not the forward it replaces. Used by every re-run of ours (``memo/steps.py``, ``checkpoint_offload.py``,
``chunked_layer.py``)::

    state = autocast_state()            # in the forward
    with as_in_forward(state, grad=True):  # in the backward: the same autocast, with autograd
        y = layer.plain_forward(x, rope)
    backward_from(y, dy)                # the re-run's output is only the graph's root
"""
from __future__ import annotations

import contextlib

import torch


def autocast_state() -> list:
    """``[(device type, dtype)]`` of the autocast contexts active now: CUDA's, the CPU's and that of the PrivateUse1
    backend (an out-of-tree accelerator, or a rehearsal's stand-in device, whose re-runs otherwise ran in fp32)."""
    devices = ("cuda", "cpu", torch._C._get_privateuse1_backend_name())
    return [(dev, torch.get_autocast_dtype(dev)) for dev in devices if torch.is_autocast_enabled(dev)]


def as_in_forward(state: list, grad: bool) -> contextlib.ExitStack:
    """The forward's autocast ``state`` entered again, with or without autograd."""
    stack = contextlib.ExitStack()
    for dev, dtype in state:
        stack.enter_context(torch.autocast(dev, dtype=dtype))
    stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
    return stack


def backward_from(y: torch.Tensor, dy: torch.Tensor) -> None:
    """``torch.autograd.backward(y, dy)`` for a re-run's output ``y`` that nothing else holds, its bytes freed
    first when its last op is a sum (``AddBackward0``: the layer's residual add, whose backward reads neither its
    inputs nor its output). The output is only the root of the graph: held through the backward it was one more
    residual-stream tensor at the re-run's peak (fp32 ``[s, b, h]``: 8 GiB for one GPU at 512K tokens). After any
    other last op it is kept (that op's backward may read it)."""
    fn = y.grad_fn
    if fn is not None and fn.name() == "AddBackward0" and y._base is None:
        y.untyped_storage().resize_(0)
    torch.autograd.backward(y, dy)
