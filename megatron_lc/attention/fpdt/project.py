"""FPDT's per-chunk QKV projection as its own small autograd graph, handed to the chunked attention and back.

The projection of chunk ``i`` runs inside the FPDT forward (so only one chunk's local q/k/v ever exists), on a
detached leaf ``x_i`` of the block input. ``_Anchor`` ties the chunk's (q, k, v) to a scalar handle; in the FPDT
backward, when chunk ``i``'s dq/dk/dv are complete, ``backward_chunk`` runs autograd from that handle: the
projection's weight gradients accumulate through autograd (TP communication included) and ``x_i.grad`` is the
block input's gradient for that chunk. Nothing is recomputed and no weight gradient is written by hand.

What the projection graph saves (its input chunk; the rope rows) goes through ``ProjSavedHooks``: copied to host
when offloading, else kept and counted. Parameters and the model's rope tables are never moved.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...device import storage_id
from ..ulysses import replicate_kv
from .buffers import FPDTBuffers, nbytes


class Box:
    """Hands tensors between the FPDT loops and ``_Anchor`` (forward: q, k, v; backward: their gradients)."""

    __slots__ = ("value", "grads")

    def __init__(self):
        self.value = None
        self.grads = None


class _Anchor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, box: Box, q, k, v):
        ctx.box = box
        box.value = (q, k, v)
        return q.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        dq, dk, dv = ctx.box.grads
        ctx.box.grads = None
        return None, dq, dk, dv


class ProjSavedHooks:
    """``saved_tensors_hooks`` for one chunk's projection graph.

    ``keep_ptrs``: storages never moved or counted (parameters, rope tables). ``input_ptr``: the block input's
    storage (counted by nobody: it exists anyway; offloaded like the rest when offloading). ``params``: the
    projection's parameters -- under autocast the linear saves the *cast* weight (a bf16 copy, one per forward,
    shared by the chunks through autocast's cache; saved transposed by the matmul): it is kept like the parameter,
    never copied per chunk."""

    def __init__(self, bufs: FPDTBuffers, offload: bool, keep_ptrs: set, input_ptr: int, params=()):
        self.bufs, self.offload, self.keep_ptrs, self.input_ptr = bufs, offload, keep_ptrs, input_ptr
        self.param_dtypes = {shape: p.dtype for p in params for shape in (tuple(p.shape), tuple(p.shape)[::-1])}
        self.counted: list = []  # tensors accounted under fpdt.proj_saved until ``finish``
        self.hosted: list = []  # host copies made by ``pack`` (forgotten in ``finish``)

    def _weight_cast(self, t: torch.Tensor) -> bool:
        dtype = self.param_dtypes.get(tuple(t.shape))
        return dtype is not None and t.dtype != dtype

    def pack(self, t: torch.Tensor):
        ptr = storage_id(t)
        if ptr in self.keep_ptrs:
            return ("keep", t)
        if self._weight_cast(t):
            self.keep_ptrs.add(ptr)
            return ("keep", t)
        if self.offload:
            h = self.bufs.to_host(t)
            self.hosted.append(h)
            return ("host", h)
        if ptr != self.input_ptr:
            self.bufs.track("fpdt.proj_saved", t)
            self.counted.append(t)
        return ("keep", t)

    def unpack(self, packed):
        kind, v = packed
        if kind == "keep":
            return v
        p = self.bufs.fetch([v], tag="fpdt.proj_saved")
        (t,) = self.bufs.wait(p)
        self.counted.append(t)  # freed by autograd right after the node ran; released in ``finish``
        return t

    def finish(self) -> None:
        self.bufs.untrack("fpdt.proj_saved", *self.counted)
        for h in self.hosted:
            self.bufs.drop_host(h)
        self.counted, self.hosted = [], []


class ChunkProjection:
    """One chunk's projection graph: ``x_i`` leaf, the anchor, the saved-tensor hooks."""

    def __init__(self, x_leaf: torch.Tensor, anchor: Optional[torch.Tensor], box: Box,
                 hooks: Optional[ProjSavedHooks]):
        self.x_leaf, self.anchor, self.box, self.hooks = x_leaf, anchor, box, hooks

    def backward(self, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> Optional[torch.Tensor]:
        """Run the projection backward of this chunk; returns the gradient of its input chunk (or None)."""
        self.box.grads = (dq, dk, dv)
        torch.autograd.backward(self.anchor, torch.ones_like(self.anchor))
        if self.hooks is not None:
            self.hooks.finish()
        g = self.x_leaf.grad
        self.x_leaf, self.anchor = None, None
        return g


def project_chunk(qkv_fn, x_chunk: torch.Tensor, rope, kv_repeat: int, build_graph: bool, x_requires_grad: bool,
                  hooks: Optional[ProjSavedHooks]):
    """q, k, v ``[c_local, b, n, d]`` of one chunk (k/v heads repeated ``kv_repeat`` times) and its
    ``ChunkProjection`` (None when no graph is needed, e.g. under ``torch.no_grad``)."""

    def run(x):
        q, k, v = qkv_fn(x, rope)
        k, v = replicate_kv(k, v, kv_repeat)  # GQA with fewer kv heads than Ulysses ranks
        return q, k, v

    if not build_graph:
        with torch.no_grad():
            return (*run(x_chunk), None)
    x_leaf = x_chunk.detach().requires_grad_(x_requires_grad)
    box = Box()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
        q, k, v = run(x_leaf)
        anchor = _Anchor.apply(box, q, k, v)
    q, k, v = box.value
    box.value = None
    if hooks.offload:
        # every tensor the graph saved is a host copy now: the leaf only collects its gradient, so it lets go of the
        # block input's storage (a view of all u chunks, the norm's output: one residual-stream tensor held through
        # the layer's backward otherwise); autograd needs its shape, not its bytes
        x_leaf.data = x_leaf.new_empty(1).expand(x_leaf.shape)
    return q, k, v, ChunkProjection(x_leaf, anchor, box, hooks)


def storage_bytes(*ts: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``ts`` (a view keeps its whole base alive)."""
    seen, total = set(), 0
    for t in ts:
        if storage_id(t) not in seen:
            seen.add(storage_id(t))
            total += t.untyped_storage().nbytes()
    return total


__all__ = ["Box", "ChunkProjection", "ProjSavedHooks", "project_chunk", "storage_bytes", "nbytes"]
