"""One layer's skeletal tensors: what its backward needs, collected during its forward.

A ``SkeletalSlot`` is filled two ways during a layer's forward:

* ``keep(kind, t)``: the executor names the tensors Memo always keeps whole -- the layer ``input``, the
  attention output (``attn``) and its ``lse`` -- and the attention's q/k/v (``other``);
* ``pack(t)``: the ``saved_tensors_hooks`` pack hook, for every tensor autograd saves in the layer's token-wise
  parts (norm inputs and outputs, linear inputs, RoPE inputs, MLP activations...). Parameters and the shared RoPE
  tables come back as references; everything else is grouped by the storage it lives in.

Grouping by storage: several saved tensors are views of one storage (q and k before RoPE and v are views of the
fused QKV output; the layer input is saved by the first norm as a view). Each storage is copied once, over the byte
range that covers all its saved views, and every view is rebuilt from that copy with its own size/stride/offset.

``flush(buffer)`` copies the groups into a rounding buffer (``offload.RoundingBuffer``) and drops the references
to the originals, so autograd's own allocations are freed. In ``device`` mode nothing is copied: tensors are kept
by reference (plain ``recompute_granularity: full``). ``unpack`` rebuilds a saved tensor from the buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

KINDS = ("input", "attn", "lse", "other")


@dataclass
class _Group:
    """Saved views of one storage. Copied as one byte range when the views cover it (``dense``), else view by
    view (e.g. v alone out of the fused QKV output: its rows are strided, the range would drag q and k along)."""

    kind: str
    storage: Optional[torch.UntypedStorage]
    device: torch.device
    dtype: torch.dtype
    start: int  # bytes, into the storage
    end: int
    views: dict = field(default_factory=dict)  # (offset, size, stride) -> index
    view_bytes: list = field(default_factory=list)
    region: Optional[int] = None  # byte offset of the range copy in the rounding buffer (dense)
    view_regions: list = field(default_factory=list)  # byte offsets of the view copies (not dense)

    @property
    def dense(self) -> bool:
        return sum(self.view_bytes) >= self.end - self.start

    @property
    def nbytes(self) -> int:
        return self.end - self.start if self.dense else sum(self.view_bytes)

    def add_view(self, offset: int, size: tuple, stride: tuple, nbytes: int) -> int:
        key = (offset, size, stride)
        if key not in self.views:
            self.views[key] = len(self.views)
            self.view_bytes.append(nbytes)
        return self.views[key]


@dataclass
class _Handle:
    group: Optional[_Group]
    offset: int = 0  # bytes into the storage
    size: tuple = ()
    stride: tuple = ()
    index: int = 0  # which view of the group
    ref: Optional[torch.Tensor] = None  # kept by reference (parameters, RoPE tables, device mode)


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
    """Bytes of the groups by kind (union extents, not padded) and token counts of one layer."""

    bytes: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    tokens: int = 0
    tokens_kept: int = 0  # first tokens of every ``other`` tensor, offloaded (or kept) instead of recomputed
    tokens_recomputed: int = 0
    bytes_recomputed: int = 0  # bytes of the recomputed tokens' skeletal tensors (the same grouping)
    bytes_to_host: int = 0
    bytes_from_host: int = 0


class SkeletalSlot:
    """Skeletal tensors of layer ``layer`` in one forward/backward (``mode``: device | rounding | measure)."""

    def __init__(self, layer: int, mode: str, refs: set):
        assert mode in ("device", "rounding", "measure")
        self.layer, self.mode = layer, mode
        self.refs = refs  # storage data_ptrs kept by reference
        self.groups: dict = {}
        self.stats = SlotStats()
        self.flushed = False
        self.buffer = None  # the RoundingBuffer holding the groups after flush
        self.default_kind = "other"  # kind of groups first seen by ``pack`` (``attn`` while a whole block runs)
        self.generation = -1

    # ---- forward -------------------------------------------------------------------------------------------
    def _group_for(self, t: torch.Tensor, kind: str) -> _Group:
        key = (t.untyped_storage().data_ptr(), t.dtype)
        start, end = _extent(t)
        g = self.groups.get(key)
        if g is None:
            g = _Group(kind, t.untyped_storage(), t.device, t.dtype, start, end)
            self.groups[key] = g
        else:
            g.start, g.end = min(g.start, start), max(g.end, end)
            if kind != "other" and g.kind == "other":
                g.kind = kind
        return g

    def pack(self, t: torch.Tensor) -> _Handle:
        """saved_tensors_hooks pack: a handle for ``t`` (must be called before ``flush``)."""
        if self.mode == "device" or t.numel() == 0 or t.untyped_storage().data_ptr() in self.refs \
                or (t.requires_grad and _from_parameter(t)):
            return _Handle(None, ref=t)
        if self.flushed:
            raise RuntimeError(f"layer {self.layer}: a tensor was saved after the layer's skeletal tensors were "
                               f"flushed to the rounding buffer")
        g = self._group_for(t, self.default_kind)
        offset, size, stride = t.storage_offset() * t.element_size(), tuple(t.shape), tuple(t.stride())
        index = g.add_view(offset, size, stride, t.numel() * t.element_size())
        return _Handle(g, offset, size, stride, index, ref=t if self.mode == "measure" else None)

    def keep(self, kind: str, t: torch.Tensor) -> _Handle:
        """Keep ``t`` whole as ``kind`` (input | attn | lse | other)."""
        if self.mode == "device":
            self.stats.bytes[kind] += t.numel() * t.element_size()
            return _Handle(None, ref=t.detach())
        h = self.pack(t.detach())
        if h.group is not None and kind != "other":
            h.group.kind = kind
        return h

    def group_bytes(self) -> dict:
        out = {k: 0 for k in KINDS}
        for g in self.groups.values():
            out[g.kind] += g.nbytes
        return out

    def flush(self, buffer) -> None:
        """Copy every group into ``buffer`` (rounding mode) and release the originals; count bytes by kind."""
        if self.mode == "device":
            self.flushed = True
            return
        by_kind = self.group_bytes()
        for k in KINDS:
            self.stats.bytes[k] += by_kind[k]
        if self.mode == "rounding":
            buffer.reset()
            for g in self.groups.values():
                src = torch.empty(0, dtype=torch.uint8, device=g.device).set_(g.storage, 0, (g.storage.nbytes(),),
                                                                              (1,))
                if g.dense:
                    g.region = buffer.alloc(g.nbytes)
                    buffer.data[g.region:g.region + g.nbytes].copy_(src[g.start:g.end], non_blocking=True)
                    continue
                typed = src.view(g.dtype)
                es = typed.element_size()
                for (offset, size, stride), nbytes in zip(g.views, g.view_bytes):
                    r = buffer.alloc(nbytes)
                    g.view_regions.append(r)
                    dst = buffer.data[r:r + nbytes].view(g.dtype).view(size)
                    dst.copy_(typed.as_strided(size, stride, offset // es), non_blocking=True)
            self.buffer = buffer
            for g in self.groups.values():
                g.storage = None
        self.flushed = True

    # ---- backward ------------------------------------------------------------------------------------------
    def unpack(self, h: _Handle) -> torch.Tensor:
        """saved_tensors_hooks unpack: the saved tensor, rebuilt from the rounding buffer when it was copied."""
        if h.ref is not None:
            return h.ref
        g = h.group
        if self.buffer is None or (g.region is None and not g.view_regions):
            raise RuntimeError(f"layer {self.layer}: skeletal tensors were never flushed to a rounding buffer")
        self.buffer.check_owner(self)
        if not g.dense:
            r = g.view_regions[h.index]
            return self.buffer.data[r:r + g.view_bytes[h.index]].view(g.dtype).view(h.size)
        es = torch.empty((), dtype=g.dtype).element_size()
        typed = self.buffer.data[g.region:g.region + g.nbytes].view(g.dtype)
        return typed.as_strided(h.size, h.stride, typed.storage_offset() + (h.offset - g.start) // es)

    def used_bytes(self, align: int) -> int:
        """Bytes this slot needs in a rounding buffer (each group aligned)."""
        pad = lambda n: (n + align - 1) // align * align  # noqa: E731
        return sum(pad(g.nbytes) if g.dense else sum(pad(n) for n in g.view_bytes) for g in self.groups.values())
