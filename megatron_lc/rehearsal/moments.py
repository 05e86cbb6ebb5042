"""Where a step is, written beside the tracker's trace: ``Moments.log`` holds (event index, label) at every change,
so the peak's event index names its moment. Labels, in a step's order (k the step, m the micro-batch, i a layer)::

    setup                              before setup's first stage (the tracker starts)
    setup S                            setup's stages: data, build (the model on the host), device (FSDP2's
                                       shards, the move), runtimes (calibrations), optimizer, checkpoint
    step k mb m forward                the embedding and the head (outside the layers)
    step k mb m layer i forward        layer i's forward
    step k mb m layer i backward       layer i's backward (a re-run in backward is part of it)
    step k mb m backward               between layers' backwards and after layer 0's (embedding, grad sync)
    step k optimizer                   clipping's end and the optimizer step

Each label belongs to a phase (``phase``): setup's stages as they are, then ``step k forward``, ``step k backward``
and ``step k optimizer``; ``on_phase`` is told each phase as it starts, once (a rehearsal's progress lines).
"""
from __future__ import annotations

from typing import Callable

import torch


def phase(label: str) -> str:
    """The phase of a label: ``setup S`` as it is; ``step k mb m layer i backward`` -> ``step k backward``."""
    words = label.split()
    if words[0] == "setup":
        return label
    if "optimizer" in words:
        return f"step {words[1]} optimizer"
    return f"step {words[1]} {'backward' if 'backward' in words else 'forward'}"


class Moments:
    def __init__(self, events: list, on_phase: Callable[[str], None] = lambda name: None):
        self.events = events  # the tracker's event list (its length is the next event's index)
        self.log: list = []  # (event index, label)
        self.on_phase, self.phases = on_phase, set()
        self.step = 0
        self.micro = -1
        self.backward = False
        self.set("setup")

    def set(self, label: str) -> None:
        self.log.append((len(self.events), label))
        p = phase(label)
        if p not in self.phases:  # a later micro-batch's forward is still its step's forward phase
            self.phases.add(p)
            self.on_phase(p)

    def start_step(self, k: int) -> None:
        self.step, self.micro, self.backward = k, -1, False

    def at(self, index: int) -> str:
        """The label in force at event ``index``."""
        label = self.log[0][1]
        for i, name in self.log:
            if i > index:
                break
            label = name
        return label

    def install(self, model, optimizer) -> list:
        """Hooks on ``model`` (a GPTModel) and ``optimizer`` that set the labels; returns the handles."""
        handles = []

        def model_pre(mod, args):
            self.micro += 1
            self.backward = False
            self.set(f"step {self.step} mb {self.micro} forward")

        handles.append(model.register_forward_pre_hook(model_pre))
        for i, layer in enumerate(model.layers):
            def pre(mod, args, i=i):
                if self.backward:  # a layer re-run inside its own backward
                    return
                self.set(f"step {self.step} mb {self.micro} layer {i} forward")
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda g, i=i: self._after_backward(i))

            def post(mod, args, out, i=i):
                if self.backward:
                    return
                self.set(f"step {self.step} mb {self.micro} forward")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g, i=i: self._backward(i))

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))
        handles.append(optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self.set(f"step {self.step} optimizer")))
        return handles

    def _backward(self, i: int) -> None:
        self.backward = True
        self.set(f"step {self.step} mb {self.micro} layer {i} backward")

    def _after_backward(self, i: int) -> None:
        """Layer i's input has its gradient: its backward is over (its input is also layer i-1's output, whose
        hook runs first and has already named layer i-1's backward)."""
        if self.log[-1][1] == f"step {self.step} mb {self.micro} layer {i} backward":
            self.set(f"step {self.step} mb {self.micro} backward")
