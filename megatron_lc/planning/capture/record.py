"""Capturing memory request traces (the job profiler of Memo §4.3.2).

Any device, real or fake tensors: ``tracker.DispatchTracer``, the live-bytes tracker (a ``TorchDispatchMode``: each
storage keyed by identity, a malloc when an op creates it or a resize gives it bytes, a free when it dies or is
resized to 0). Layer and phase marks come from module hooks (forward) and tensor gradient hooks (backward):

    layer i forward pre-hook  -> mark (i, "fwd");   layer i forward hook -> mark none
    grad of layer i's output  -> mark (i, "bwd");   grad of layer i's input -> mark none (if still (i, "bwd"))

A layer re-run during backward (activation recompute) is marked (i, "bwd"), part of its backward block.

    trace = capture_iteration(model, batch)          # one micro-batch forward + backward, all layers
    trace = capture_layer(model.layers[0], x, rope)  # one layer's forward + backward (§4.3.2: identical layers)

Not seen by the tracker: allocations made by C++ code that does not go through the dispatcher, scratch an op frees
inside itself, and the allocator's own rounding (sizes are exact ``nbytes``).

GPU: ``trace_from_snapshot`` converts ``torch.cuda.memory._snapshot()`` device traces recorded with
``torch.cuda.memory._record_memory_history`` (sizes rounded by the allocator) -- the conversion is tested on a
synthetic snapshot; ``record_cuda_iteration`` (the recording itself) was never executed here (no GPU).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ...memory.arena import Arena
from ..trace import Event, Trace
from .tracker import DispatchTracer


def _mark_layers(tracer: DispatchTracer, layers) -> list:
    """Install the forward/backward mark hooks on ``layers``; returns the handles to remove."""
    handles = []

    def start_bwd(i):
        def hook(grad):
            tracer.set_mark((i, "bwd"))
        return hook

    def end_bwd(i):
        def hook(grad):
            if tracer.mark == (i, "bwd"):
                tracer.set_mark(None)
        return hook

    for i, layer in enumerate(layers):
        def pre(mod, args, i=i):
            tracer.set_mark((i, "bwd" if tracer.phase == "bwd" else "fwd"))
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad:
                x.register_hook(end_bwd(i))

        def post(mod, args, out, i=i):
            if tracer.phase != "bwd":
                tracer.set_mark(None)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(start_bwd(i))

        handles.append(layer.register_forward_pre_hook(pre))
        handles.append(layer.register_forward_hook(post))
    return handles


class RecordingArena(Arena):
    """An ``Arena`` (fresh allocations) whose transient buffers are tagged in ``tracer``'s trace; persistent buffers
    are left out of the trace (the planned arena gives them a static region)."""

    def __init__(self, tracer: DispatchTracer, device=None):
        super().__init__(device)
        self.tracer = tracer

    def _transient(self, tag, k, shape, dtype, device):
        t = super()._transient(tag, k, shape, dtype, device)
        self.tracer.tag(t, tag)
        return t

    def _persistent_buffer(self, tag, shape, dtype, device):
        t = super()._persistent_buffer(tag, shape, dtype, device)
        self.tracer.forget(t)
        return t


def capture_iteration(model: torch.nn.Module, batch: dict, arena=None, layers=None, meta=None,
                      autocast=contextlib.nullcontext) -> Trace:
    """Trace one forward + backward of ``model`` (a GPTModel: ``model(tokens, position_ids, labels)`` -> per-token
    loss) on ``batch``; ``autocast``: a factory of the training step's autocast context, entered for the forward
    only (as the loop does). Storages of the batch's device only. Gradients are left in ``.grad`` (never freed in
    the trace); the caller clears them.
    ``arena``: the model context's ``ArenaHandle``; its framework buffers are served by a ``RecordingArena`` during
    the capture (tagged in the trace; the persistent ones listed in ``trace.meta["persistent"]``), then the
    previous arena is put back."""
    layers = layers if layers is not None else getattr(model, "layers", [])
    tracer = DispatchTracer(batch["tokens"].device.type)
    rec = RecordingArena(tracer)
    old = arena.install(rec) if arena is not None else None
    handles = _mark_layers(tracer, layers)
    try:
        with tracer:
            with autocast():  # the forward as the training step runs it; backward outside, as there
                loss = model(batch["tokens"], batch["position_ids"], batch["labels"], batch.get("documents"))
            loss = (loss.float() * batch["loss_mask"]).sum() / batch["loss_mask"].sum().clamp(min=1)
            tracer.phase = "bwd"
            tracer.set_mark(None)
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        if arena is not None:
            arena.install(old)
    m = dict(meta or {})
    m["persistent"] = rec.persistent_layout()
    return tracer.trace(m)


def capture_layer(layer: torch.nn.Module, x: torch.Tensor, *args, meta=None) -> Trace:
    """Trace one layer's forward and backward alone: ``layer(x, *args)`` with ``x`` requiring grad, then backward
    with a gradient of ones. Events are marked (0, "fwd") and (0, "bwd")."""
    x = x.detach().requires_grad_(True)
    tracer = DispatchTracer()
    with tracer:
        tracer.set_mark((0, "fwd"))
        out = layer(x, *args)
        g = torch.ones_like(out)
        tracer.phase = "bwd"
        tracer.set_mark((0, "bwd"))
        out.backward(g)
        del out, g
    return tracer.trace(meta)


# ---- GPU: the CUDA caching allocator's memory history (never executed here: no GPU) ---------------------------

def trace_from_snapshot(snapshot: dict, device: int = 0, marks: Optional[list] = None) -> Trace:
    """Convert ``torch.cuda.memory._snapshot()`` (recorded with ``_record_memory_history``) to a trace: ``alloc``
    -> malloc, ``free_completed`` -> free (sizes as the allocator rounded them). ``marks``: optional list of
    ``(time_us, layer or None, phase)`` boundaries; events are stamped with the last mark at or before their
    ``time_us``. Allocations live before recording started have no alloc entry; their frees are skipped."""
    entries = snapshot["device_traces"][device]
    marks = sorted(marks or [], key=lambda m: m[0])
    live: dict = {}  # addr -> id
    events, nid, mk = [], 0, 0
    cur = (None, None)
    for ent in entries:
        while mk < len(marks) and ent.get("time_us", 0) >= marks[mk][0]:
            cur = (marks[mk][1], marks[mk][2])
            mk += 1
        layer, phase = cur
        action = ent.get("action")
        if action == "alloc":
            live[ent["addr"]] = nid
            events.append(Event("malloc", nid, int(ent["size"]), layer, phase if layer is not None else None))
            nid += 1
        elif action == "free_completed" and ent["addr"] in live:
            rid = live.pop(ent["addr"])
            events.append(Event("free", rid, int(ent["size"]), layer, phase if layer is not None else None))
    t = Trace(events, {"source": "cuda_memory_history", "device": device})
    t.validate("cuda snapshot")
    return t


def record_cuda_iteration(model, batch, device: int = 0) -> Trace:  # pragma: no cover - GPU only
    """Run one forward+backward with the CUDA allocator's history on and convert it (never executed here).
    The tracer is not entered as a dispatch mode: only its layer hooks run, logging mark times."""
    tracer = DispatchTracer()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    handles = _mark_layers(tracer, getattr(model, "layers", []))
    try:
        loss = model(batch["tokens"], batch["position_ids"], batch["labels"], batch.get("documents"))
        loss = (loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        tracer.phase = "bwd"
        tracer.set_mark(None)
        loss.backward()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        for h in handles:
            h.remove()
        torch.cuda.memory._record_memory_history(enabled=None)
    return trace_from_snapshot(snap, device, tracer.mark_log)
