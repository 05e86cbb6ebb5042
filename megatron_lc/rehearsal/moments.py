"""Where a rehearsal is, written beside the tracker's trace: ``Moments.log`` holds (event index, label) at every
change, so the peak's event index names its moment. Labels, in a job's order (k the step, m the micro-batch, i a
layer)::

    setup                              before setup's first stage (the tracker starts)
    setup S                            setup's stages: data, build (the model on the device), device (FSDP2's
                                       shards), runtimes (calibrations), optimizer, checkpoint
    step k mb m forward                the embedding and the head (outside the layers)
    step k mb m layer i forward        layer i's forward
    step k mb m layer i backward       layer i's backward (a re-run in backward is part of it)
    step k mb m backward               between layers' backwards and after layer 0's (embedding, grad sync)
    step k optimizer                   clipping's end and the optimizer step
    validation mb m layer i forward    the validation pass's forward (no backward), and so on
    save, async save, resume           the checkpoint phases of the job (``job.py``)

Each label belongs to a phase (``phase``): setup's stages as they are, ``step k forward``, ``step k backward`` and
``step k optimizer``, ``validation``, ``save``...; ``on_phase`` is told each phase as it starts, once (a
rehearsal's progress lines). Coarser, ``segments`` cut the trace into the job's parts (``begin``): ``setup``,
``steps``, then ``validation``, ``save``, ``async save``, ``resume``, ``resumed step`` when the job runs them.
"""
from __future__ import annotations

from typing import Callable

import torch


def phase(label: str) -> str:
    """The phase of a label: ``setup S`` as it is; ``step k mb m layer i backward`` -> ``step k backward``;
    ``validation mb 0 layer 3 forward`` -> ``validation``."""
    words = label.split()
    if words[0] == "setup":
        return label
    if words[0] != "step":
        return label.split(" mb ")[0]
    if "optimizer" in words:
        return f"step {words[1]} optimizer"
    return f"step {words[1]} {'backward' if 'backward' in words else 'forward'}"


class Moments:
    def __init__(self, events: list, on_phase: Callable[[str], None] = lambda name: None):
        self.events = events  # the tracker's event list (its length is the next event's index)
        self.log: list = []  # (event index, label)
        self.on_phase, self.phases = on_phase, set()
        self.step = 0
        self.prefix = "step 0"  # what the model's hooks put before "mb m ...": the step, or a pass (validation)
        self.micro = -1
        self.backward = False
        self.segments: list = [(0, "setup")]  # (event index, part of the job)
        self.set("setup")

    def begin(self, segment: str) -> None:
        """The job's next part starts (``steps``, ``validation``, ``save``...)."""
        self.segments.append((len(self.events), segment))

    def set(self, label: str) -> None:
        self.log.append((len(self.events), label))
        p = phase(label)
        if p not in self.phases:  # a later micro-batch's forward is still its step's forward phase
            self.phases.add(p)
            self.on_phase(p)

    def start_step(self, k: int) -> None:
        self.step, self.prefix, self.micro, self.backward = k, f"step {k}", -1, False

    def start_pass(self, name: str) -> None:
        """A forward pass of the model outside a step (``validation``): its hooks' labels begin with ``name``."""
        self.prefix, self.micro, self.backward = name, -1, False
        self.set(name)

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
            self.set(f"{self.prefix} mb {self.micro} forward")

        handles.append(model.register_forward_pre_hook(model_pre))
        for i, layer in enumerate(model.layers):
            def pre(mod, args, i=i):
                if self.backward:  # a layer re-run inside its own backward
                    return
                self.set(f"{self.prefix} mb {self.micro} layer {i} forward")
                x = args[0] if args else None
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda g, i=i: self._after_backward(i))

            def post(mod, args, out, i=i):
                if self.backward:
                    return
                self.set(f"{self.prefix} mb {self.micro} forward")
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(lambda g, i=i: self._backward(i))

            handles.append(layer.register_forward_pre_hook(pre))
            handles.append(layer.register_forward_hook(post))
        handles.append(optimizer.register_step_pre_hook(
            lambda opt, args, kwargs: self.set(f"step {self.step} optimizer")))
        return handles

    def _backward(self, i: int) -> None:
        self.backward = True
        self.set(f"{self.prefix} mb {self.micro} layer {i} backward")

    def _after_backward(self, i: int) -> None:
        """Layer i's input has its gradient: its backward is over (its input is also layer i-1's output, whose
        hook runs first and has already named layer i-1's backward)."""
        if self.log[-1][1] == f"{self.prefix} mb {self.micro} layer {i} backward":
            self.set(f"{self.prefix} mb {self.micro} backward")
