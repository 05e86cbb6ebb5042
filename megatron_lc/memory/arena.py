"""Static arena: the framework's own device buffers as views of one planned buffer.

The API every framework-buffer creator uses (FPDT chunk buffers, MsT chunk buffers, Memo rounding buffers, logits
chunks, all-to-all buffers) -- one call, the same on every device, with or without a plan:

    class MyChunkedThing(nn.Module):
        def __init__(self, cfg, parts):
            super().__init__()
            self.arena = parts.ctx.arena              # the model's ArenaHandle: plain until a plan is installed
        def forward(self, x):
            buf = self.arena.buffer("mst.mlp_chunk", (chunk, b, f), x.dtype, device=x.device)
            ...                                       # contents undefined; drop it when done

Rules of the API:

- ``buffer(tag, shape, dtype, device=...)`` is *transient*: call it every time the buffer is needed (every layer,
  every iteration) and do not keep the tensor beyond its use. The k-th request of a tag in an iteration gets the k-th
  planned slot of that tag, so the address is identical every iteration. Contents are undefined.
- ``buffer(..., persistent=True)`` is allocated once per tag and returned again on later requests (e.g. Memo's two
  rounding buffers): ask for it each time instead of keeping it, so a newly installed arena can serve it.
- An iteration is one forward + backward of one micro-batch; the model's forward resets the per-tag counters
  (``ArenaHandle.begin_iteration``).

``Arena`` (default) allocates fresh tensors and counts them. ``PlannedArena`` holds *one* buffer of the planned size
and hands out views at planned offsets; a request that diverges from the plan (unknown tag or occurrence, larger
size, or its slot still in use by a live buffer) falls back to a fresh allocation with a warning and a counter.
Each planned view gets its own storage object aliasing the arena memory, so its liveness (storage death) is tracked
exactly like an allocation's and a slot is never handed out while an earlier buffer in it is alive. On GPU, a
buffer used on a side stream must be declared with ``arena.record_stream(t, stream)`` (the caching allocator's
``record_stream`` does not see arena memory): when it dies an event is recorded on that stream, and the next
buffer handed out over the same bytes makes the compute stream wait for it (never executed here: no GPU).
"""
from __future__ import annotations

import logging
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from typing import Optional, Sequence

import torch

from ..device import DeviceAdapter

log = logging.getLogger("megatron_lc")

ALIGNMENT = 512  # bytes; offsets and sizes in the arena are multiples of this (the CUDA allocator's granule)


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return -(-n // alignment) * alignment


@dataclass
class ArenaStats:
    """Counters of buffer requests. ``fresh_allocations`` counts requests served by a new allocation (no plan, or a
    fallback); after a plan is installed it must stay zero."""

    requests: int = 0
    planned: int = 0
    fresh_allocations: int = 0
    fallbacks: int = 0
    by_tag: dict = field(default_factory=lambda: defaultdict(lambda: {"planned": 0, "fresh": 0}))

    def count(self, tag: str, planned: bool) -> None:
        self.requests += 1
        if planned:
            self.planned += 1
            self.by_tag[tag]["planned"] += 1
        else:
            self.fresh_allocations += 1
            self.by_tag[tag]["fresh"] += 1

    def reset(self) -> None:
        self.requests = self.planned = self.fresh_allocations = self.fallbacks = 0
        self.by_tag.clear()

    def summary(self) -> dict:
        return {"requests": self.requests, "planned": self.planned, "fresh_allocations": self.fresh_allocations,
                "fallbacks": self.fallbacks, "by_tag": {k: dict(v) for k, v in self.by_tag.items()}}


class Arena:
    """No plan: every transient request is a fresh ``torch.empty``; persistent buffers are allocated once per tag."""

    # False: buffers are fresh allocations, which the caching allocator keeps per stream (one made on a side stream
    # never holds bytes a compute kernel may still read); True: they are slots whose bytes held other buffers
    planned = False

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device) if device is not None else None
        self.stats = ArenaStats()
        self._occurrence: dict = defaultdict(int)
        self._persistent: dict = {}

    def buffer(self, tag: str, shape: Sequence[int], dtype: torch.dtype, *, device=None,
               persistent: bool = False) -> torch.Tensor:
        """A tensor of ``shape``/``dtype`` for framework buffer ``tag`` (contents undefined)."""
        shape = tuple(int(s) for s in shape)
        dev = torch.device(device) if device is not None else (self.device or torch.device("cpu"))
        if persistent:
            return self._persistent_buffer(tag, shape, dtype, dev)
        k = self._occurrence[tag]
        self._occurrence[tag] += 1
        return self._transient(tag, k, shape, dtype, dev)

    def begin_iteration(self) -> None:
        """Start a new iteration: the next request of each tag is its occurrence 0 again."""
        self._occurrence.clear()

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """``tensor`` (from this arena) is used on side ``stream``: its memory must not be handed out again before
        that work ran. Plain allocations rely on the caching allocator (``DeviceAdapter.record_stream``)."""
        return None

    # ---- overridden by planned / recording arenas ----------------------------------------------------------
    def _transient(self, tag: str, k: int, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.stats.count(tag, planned=False)
        return torch.empty(shape, dtype=dtype, device=device)

    def _persistent_buffer(self, tag, shape, dtype, device) -> torch.Tensor:
        t = self._persistent.get(tag)
        if t is None or t.shape != shape or t.dtype != dtype or t.device != device:
            self.stats.count(tag, planned=False)
            t = torch.empty(shape, dtype=dtype, device=device)
            self._persistent[tag] = t
        return t

    def persistent_layout(self) -> dict:
        """``{tag: nbytes}`` of the persistent buffers this arena holds (recorded into plans)."""
        return {tag: t.numel() * t.element_size() for tag, t in self._persistent.items()}


@dataclass(frozen=True)
class Slot:
    offset: int
    nbytes: int


@dataclass
class ArenaLayout:
    """Where each framework buffer lives in the arena: transient slots keyed by ``(tag, occurrence)`` and persistent
    buffers by tag, all offsets relative to the arena start. ``size_bytes`` is the arena size."""

    size_bytes: int
    slots: dict  # (tag, k) -> Slot
    persistent: dict  # tag -> Slot

    def check(self) -> None:
        """Raise ValueError when two persistent buffers overlap or a slot lies outside the arena."""
        for s in list(self.slots.values()) + list(self.persistent.values()):
            if s.offset < 0 or s.offset + s.nbytes > self.size_bytes:
                raise ValueError(f"arena slot [{s.offset}, {s.offset + s.nbytes}) outside arena of {self.size_bytes}")
        ps = sorted(self.persistent.values(), key=lambda s: s.offset)
        for a, b in zip(ps, ps[1:]):
            if a.offset + a.nbytes > b.offset:
                raise ValueError(f"persistent buffers overlap at offset {b.offset}")


def _alias(base: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``base``'s memory at byte ``offset`` with its *own* storage object (so its death is observable).
    Uses torch's private ``_construct_storage_from_data_pointer`` (no-op deleter); the arena keeps ``base`` alive."""
    nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
    st = torch._C._construct_storage_from_data_pointer(base.data_ptr() + offset, base.device, nbytes)
    return torch.empty(0, dtype=dtype, device=base.device).set_(st, 0, shape)


class PlannedArena(Arena):
    """One buffer of ``layout.size_bytes``; transient and persistent buffers are views at their planned offsets.

    Fallback (fresh allocation, ``stats.fallbacks`` += 1, one warning per tag and reason) when a request is not in
    the plan, is larger than its slot, or its slot overlaps a buffer handed out earlier that is still alive."""

    planned = True

    def __init__(self, layout: ArenaLayout, device=None):
        super().__init__(device)
        layout.check()
        self.layout = layout
        self.base = torch.empty(layout.size_bytes, dtype=torch.uint8, device=self.device or torch.device("cpu"))
        self.dev = DeviceAdapter.for_device(self.base.device)
        self._live: dict = {}  # serial -> (offset, end)
        self._serial_of: dict = {}  # id(storage) -> serial, while alive
        self._streams: dict = {}  # serial -> side streams the buffer was used on
        self._pending: list = []  # (offset, end, event): released slots whose side-stream work may still run
        self._serial = 0
        self._warned: set = set()

    def _fallback(self, tag: str, reason: str, shape, dtype, device) -> torch.Tensor:
        self.stats.fallbacks += 1
        if (tag, reason) not in self._warned:
            self._warned.add((tag, reason))
            log.warning("arena: request %r %s diverges from the plan (%s); allocating it normally", tag, shape,
                        reason)
        self.stats.count(tag, planned=False)
        return torch.empty(shape, dtype=dtype, device=device)

    def _view(self, tag: str, slot: Slot, shape, dtype, device) -> Optional[torch.Tensor]:
        nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
        if device != self.base.device:
            return self._fallback(tag, f"device {device} is not the arena's {self.base.device}", shape, dtype, device)
        if nbytes > slot.nbytes:
            return self._fallback(tag, f"{nbytes} bytes > planned {slot.nbytes}", shape, dtype, device)
        end = slot.offset + nbytes
        for o, e in self._live.values():
            if o < end and slot.offset < e:
                return self._fallback(tag, "its slot is still in use", shape, dtype, device)
        self._wait_pending(slot.offset, end)
        t = _alias(self.base, slot.offset, shape, dtype)
        serial = self._serial
        self._serial += 1
        self._live[serial] = (slot.offset, end)
        st = t.untyped_storage()
        self._serial_of[id(st)] = serial
        weakref.finalize(st, self._release, serial, id(st))
        self.stats.count(tag, planned=True)
        return t

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        serial = self._serial_of.get(id(tensor.untyped_storage()))
        if serial is not None and stream is not None:
            self._streams.setdefault(serial, []).append(stream)

    def _release(self, serial: int, key: int) -> None:
        o, e = self._live.pop(serial)
        self._serial_of.pop(key, None)
        for s in self._streams.pop(serial, ()):  # GPU: the slot is free once the side stream's queued work ran
            self._pending.append((o, e, self.dev.record_event(s)))

    def _wait_pending(self, lo: int, hi: int) -> None:
        keep = []
        for o, e, ev in self._pending:
            if o < hi and lo < e:
                self.dev.wait_event(ev)  # the compute stream (and what it later signals) waits for that work
            else:
                keep.append((o, e, ev))
        self._pending = keep

    def _transient(self, tag, k, shape, dtype, device) -> torch.Tensor:
        slot = self.layout.slots.get((tag, k))
        if slot is None:
            return self._fallback(tag, f"occurrence {k} not planned", shape, dtype, device)
        return self._view(tag, slot, shape, dtype, device)

    def _persistent_buffer(self, tag, shape, dtype, device) -> torch.Tensor:
        t = self._persistent.get(tag)
        if t is not None and t.shape == shape and t.dtype == dtype and t.device == device:
            return t
        slot = self.layout.persistent.get(tag)
        if slot is None:
            t = self._fallback(tag, "persistent buffer not planned", shape, dtype, device)
        else:
            nbytes = prod(shape) * torch.empty((), dtype=dtype).element_size()
            if nbytes > slot.nbytes or device != self.base.device:
                t = self._fallback(tag, f"persistent {nbytes} bytes on {device} != plan", shape, dtype, device)
            else:
                t = _alias(self.base, slot.offset, shape, dtype)  # lives as long as the arena
                self.stats.count(tag, planned=True)
        self._persistent[tag] = t
        return t


class ArenaHandle:
    """Where a model's framework buffers come from: one handle per model, in the context ``build_model`` returns,
    given by the model spec to every buffer creator (FPDT's chunk buffers). It serves from a plain ``Arena`` until
    a memory plan installs a ``PlannedArena`` (or the trace capture a recording one): the creators never change.
    The model's forward starts an arena iteration (``begin_iteration``)."""

    def __init__(self, arena: Optional[Arena] = None):
        self.current = arena if arena is not None else Arena()

    def install(self, arena: Arena) -> Arena:
        """Serve from ``arena`` from now on; returns the previous one."""
        old, self.current = self.current, arena
        return old

    def buffer(self, tag: str, shape: Sequence[int], dtype: torch.dtype, *, device=None,
               persistent: bool = False) -> torch.Tensor:
        return self.current.buffer(tag, shape, dtype, device=device, persistent=persistent)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        self.current.record_stream(tensor, stream)

    @property
    def planned(self) -> bool:
        return self.current.planned

    def begin_iteration(self) -> None:
        self.current.begin_iteration()
