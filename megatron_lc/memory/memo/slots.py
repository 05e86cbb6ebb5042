"""One layer's skeletal tensors: what its backward needs, placed in a rounding buffer while its forward runs.

A ``SkeletalSlot`` is filled two ways during a layer's forward:

* ``keep(kind, t)``: the executor names the tensors Memo always keeps whole -- the layer ``input``, the
  attention output (``attn``) and its ``lse`` -- and the attention's q/k/v of the kept tokens (``other``);
* ``pack(t)``: the ``saved_tensors_hooks`` pack hook, for every tensor autograd saves in the layer's token-wise
  parts (norm inputs and outputs, linear inputs, MLP activations...). Parameters (and autograd's casts of them) and
  the shared RoPE tables come back as references.

Placement (rounding mode): each saved tensor is copied into the layer's rounding buffer *when it is saved*, so
autograd's own allocation is freed as soon as the forward is done with it -- the layer's skeletal tensors live in
the buffer, as in Memo. A tensor whose elements fill a byte range of its storage (dense: the layer input, a linear
input) is copied as that range, and later views inside the range reuse it (the first norm saves a view of the kept
input; the out-projection saves a 2-D view of the attention output). A strided view (v out of the fused QKV
output, the gate half of the SwiGLU input) is copied alone, contiguous -- never the rest of its storage.

``measure`` mode places nothing (the profiler and the recompute counters use the same byte rule); ``device`` mode
keeps references (plain ``recompute_granularity: full``). ``unpack`` rebuilds a saved tensor from the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ...device import storage_id

KINDS = ("input", "attn", "lse", "other")
ALIGN = 256  # bytes; every region starts on this boundary inside a rounding buffer


@dataclass
class _Region:
    """A copy in the rounding buffer: a byte range ``[start, end)`` of a storage (dense) or one view (start -1)."""

    kind: str
    dtype: torch.dtype
    nbytes: int
    start: int = -1
    end: int = -1
    offset: Optional[int] = None  # byte offset in the rounding buffer


@dataclass
class _Handle:
    region: Optional[_Region]
    offset: int = 0  # bytes into the source storage (dense regions)
    size: tuple = ()
    stride: tuple = ()
    ref: Optional[torch.Tensor] = None  # kept by reference (parameters, RoPE tables, device and measure modes)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of ``t``'s elements inside its storage."""
    es = t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset() * es, (last + 1) * es


def _from_parameter(t: torch.Tensor, depth: int = 4) -> bool:
    """True when ``t`` is a parameter seen through a few single-input ops (autocast's bf16 weight cast, ``.t()``):
    per step, not per token, so it is kept by reference, never offloaded or counted as a skeletal tensor."""
    fn = t.grad_fn
    while fn is not None and depth > 0:
        if hasattr(fn, "variable"):  # AccumulateGrad: a leaf
            return isinstance(fn.variable, torch.nn.Parameter)
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn, depth = nxt[0], depth - 1
    return False


@dataclass
class SlotStats:
    """Bytes by kind (placed regions, not padded) and token counts of one layer."""

    bytes: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    tokens: int = 0
    tokens_kept: int = 0  # first tokens of every ``other`` tensor, offloaded (or kept) instead of recomputed
    tokens_recomputed: int = 0
    bytes_recomputed: int = 0  # bytes of the recomputed tokens' skeletal tensors (the same byte rule)
    bytes_to_host: int = 0
    bytes_from_host: int = 0


class SkeletalSlot:
    """Skeletal tensors of layer ``layer`` in one forward/backward (``mode``: device | rounding | measure)."""

    def __init__(self, layer: int, mode: str, refs: set):
        assert mode in ("device", "rounding", "measure")
        self.layer, self.mode = layer, mode
        self.refs = refs  # storage data_ptrs kept by reference
        self.regions: list = []
        self._ranges: dict = {}  # (storage ptr, dtype) -> dense regions of that storage
        self._views: dict = {}  # (storage ptr, dtype, offset, size, stride) -> view region
        self._alive: dict = {}  # storage ptr -> weak reference to the storage placed from it
        self.stats = SlotStats()
        self.flushed = False
        self.buffer = None  # the RoundingBuffer holding the regions (rounding mode)
        self.default_kind = "other"  # kind of regions placed by ``pack`` (``attn`` while a whole block runs)
        self.generation = -1

    # ---- forward -------------------------------------------------------------------------------------------
    def begin(self, buffer) -> None:
        """Rounding mode: place into ``buffer`` from its start (the caller waited for its previous offload)."""
        self.buffer = buffer
        buffer.reset()

    def _place(self, t: torch.Tensor, kind: str) -> _Handle:
        ptr, es = storage_id(t), t.element_size()
        offset, size, stride = t.storage_offset() * es, tuple(t.shape), tuple(t.stride())
        start, end = _extent(t)
        ref = t if self.mode == "measure" else None
        # the storage of an earlier saved tensor may have been freed and its address reused by this one: forget
        # what was placed from a dead storage (its bytes are still in the buffer, its handles still valid)
        alive = self._alive.get(ptr)
        if alive is not None and alive.expired():
            self._ranges = {k: v for k, v in self._ranges.items() if k[0] != ptr}
            self._views = {k: v for k, v in self._views.items() if k[0] != ptr}
        self._alive[ptr] = StorageWeakRef(t.untyped_storage())
        for r in self._ranges.get((ptr, t.dtype), ()):
            if r.start <= start and end <= r.end:
                r.kind = kind if r.kind == "other" else r.kind
                return _Handle(r, offset, size, stride, ref=ref)
        vkey = (ptr, t.dtype, offset, size, stride)
        if vkey in self._views:
            return _Handle(self._views[vkey], offset, size, stride, ref=ref)
        dense = end - start == t.numel() * es
        r = _Region(kind, t.dtype, end - start if dense else t.numel() * es, start if dense else -1,
                    end if dense else -1)
        (self._ranges.setdefault((ptr, t.dtype), []) if dense else []).append(r)
        if not dense:
            self._views[vkey] = r
        self.regions.append(r)
        if self.mode == "rounding":
            r.offset = self.buffer.alloc(r.nbytes, self.layer)
            dst = self.buffer.data[r.offset:r.offset + r.nbytes]
            if dense:  # the region's bytes: a flat view of t's storage (no new tensor over the storage itself)
                src = t.as_strided(((end - start) // es,), (1,), start // es).view(torch.uint8)
                dst.copy_(src, non_blocking=True)
            else:
                dst.view(t.dtype).view(size).copy_(t, non_blocking=True)
        return _Handle(r, offset, size, stride, ref=ref)

    def pack(self, t: torch.Tensor) -> _Handle:
        """saved_tensors_hooks pack: a handle for ``t``."""
        if self.mode == "device" or t.numel() == 0 or storage_id(t) in self.refs \
                or (t.requires_grad and _from_parameter(t)):
            return _Handle(None, ref=t)
        if self.flushed:
            raise RuntimeError(f"layer {self.layer}: a tensor was saved after the layer's forward ended")
        return self._place(t.detach(), self.default_kind)

    def keep(self, kind: str, t: torch.Tensor) -> _Handle:
        """Keep ``t`` whole as ``kind`` (input | attn | lse | other)."""
        if self.mode == "device":
            self.stats.bytes[kind] += t.numel() * t.element_size()
            return _Handle(None, ref=t.detach())
        return self._place(t.detach(), kind)

    def placed_bytes(self) -> int:
        """Bytes the regions take in a rounding buffer, each padded to ``ALIGN`` (what a buffer must hold)."""
        return sum(-(-r.nbytes // ALIGN) * ALIGN for r in self.regions)

    def flush(self) -> None:
        """The layer's forward is over: count the placed bytes by kind."""
        if self.mode != "device":
            for r in self.regions:
                self.stats.bytes[r.kind] += r.nbytes
        self.flushed = True

    # ---- backward ------------------------------------------------------------------------------------------
    def unpack(self, h: _Handle) -> torch.Tensor:
        """saved_tensors_hooks unpack: the saved tensor, rebuilt from the rounding buffer when it was copied."""
        if h.ref is not None:
            return h.ref
        r = h.region
        self.buffer.check_owner(self)
        typed = self.buffer.data[r.offset:r.offset + r.nbytes].view(r.dtype)
        if r.start < 0:
            return typed.view(h.size)
        es = typed.element_size()
        return typed.as_strided(h.size, h.stride, typed.storage_offset() + (h.offset - r.start) // es)
