"""The autocast state of a forward, re-entered when that forward runs again for its backward, as
``torch.utils.checkpoint`` does: with ``train.bf16`` the step's forward runs under ``torch.autocast("cuda",
bfloat16)`` and autograd runs the backward outside that context, so a re-run without it would compute in fp32 --
not the forward it replaces. Used by every re-run of ours (``memo/steps.py``, ``checkpoint_offload.py``)::

    state = autocast_state()            # in the forward
    with as_in_forward(state, grad=True):  # in the backward: the same autocast, with autograd
        y = layer.plain_forward(x, rope)
"""
from __future__ import annotations

import contextlib

import torch


def autocast_state() -> list:
    """``[(device type, dtype)]`` of the autocast contexts active now."""
    return [(dev, torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu") if torch.is_autocast_enabled(dev)]


def as_in_forward(state: list, grad: bool) -> contextlib.ExitStack:
    """The forward's autocast ``state`` entered again, with or without autograd."""
    stack = contextlib.ExitStack()
    for dev, dtype in state:
        stack.enter_context(torch.autocast(dev, dtype=dtype))
    stack.enter_context(torch.enable_grad() if grad else torch.no_grad())
    return stack
