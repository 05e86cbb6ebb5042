"""The live-bytes tracker: every tensor storage a program holds, per device, as malloc/free events.

One tracker for the memory planner's trace capture (``capture.py``), the estimator's calibration peaks
(``estimate/measure.py``) and a rehearsal under fake tensors. It is a ``TorchDispatchMode``:

- **identity, not address**: a storage is keyed by its ``StorageImpl`` (``device.storage_id``; a bare storage's
  ``_cdata``, the same number), never by ``data_ptr()`` -- every fake storage reports address 0. A weak finalizer
  on the storage's Python object (which lives exactly as long as the ``StorageImpl``) emits the free, in whatever
  thread drops the storage last;
- **size, not creation**: the tracker counts each storage's *current* ``nbytes``. A storage an op creates is a
  malloc; ``UntypedStorage.resize_`` (not an op: patched while a tracker is active) and ops that resize an input
  (``aten.resize_``, ``out=`` arguments, ``inductor.resize_storage_bytes_``) change it: ``resize_(0)`` is a free,
  ``resize_(n)`` from 0 a malloc of a new trace id, and n -> m (both > 0) a malloc of m then the free of n.
  FSDP2 frees its unsharded parameters that way (``free_storage``/``alloc_storage``);
- **per device**: each storage carries the device of the tensor it was first seen on (a fake tensor's own device:
  ``cpu``, ``meta`` or ``cuda``, not its storage's ``meta``); ``trace(device="cuda")`` or ``peak("meta")`` select
  one device's storages, so a rehearsal whose stand-in accelerator is another device than the host (``meta``) can
  count it apart from host memory; ``request_id(t)`` names a storage's current id (to classify one by identity);
- **the same for real and fake tensors**: a ``FakeTensorMode`` is an infrastructure mode that runs below every user
  mode, so the tracker sees fake tensors whether it was entered inside or outside the fake mode. Storages of
  wrapper subclasses (DTensor) are their inner tensors' storages.

Events are the planner's trace format (``trace.py``: ``op``, ``id``, ``size``, optional ``layer``/``phase``/
``tag``); ``mark`` stamps them. Example (a real CPU tensor; a fake one gives the same events)::

    with DispatchTracer() as tr:
        x = torch.empty(1000)                 # malloc 0 (4000 bytes)
        x.untyped_storage().resize_(0)        # free 0
        x.untyped_storage().resize_(4000)     # malloc 1 (4000 bytes)
        del x                                 # free 1
    tr.peak().bytes == 4000

Not seen: storages an op creates and frees inside itself (kernel scratch: ``charge`` adds what a table says of them),
memory of C++ code that bypasses the dispatcher, the allocator's rounding and caching (sizes are exact ``nbytes``). A storage that exists before the
tracker starts is not counted until a resize gives it new bytes (then from that moment); one first seen at a resize
is attributed to its storage's device (for a fake tensor: ``meta``).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ...device import storage_id
from ..trace import Event, Trace


@dataclass
class Peak:
    """The largest live bytes of a selection of storages, and the moment: ``at`` is the position of the event
    that reached it in the selected events (the line of ``trace(device)``; -1: nothing allocated),
    ``layer``/``phase`` that event's mark."""

    bytes: int
    at: int
    layer: Optional[int] = None
    phase: Optional[str] = None


class _Entry:
    """One storage while it lives: its current trace id (None: no bytes counted now), size, device."""

    __slots__ = ("rid", "size", "device", "ignored")

    def __init__(self, rid: Optional[int], size: int, device: str):
        self.rid, self.size, self.device, self.ignored = rid, size, device, False


def device_matches(device: str, selection: Optional[str]) -> bool:
    """``selection`` None: every device; a type (``"cuda"``) matches every index; ``"cuda:1"`` only itself."""
    return selection is None or device == selection or device.split(":")[0] == selection


def _storages(x, out: dict) -> None:
    """Add ``{key: (storage, owner)}`` for the storages behind ``x`` (a tensor, a wrapper subclass's inner tensors,
    or an ``UntypedStorage``); ``owner`` gives the device: a tensor wins over a bare storage (a fake tensor's
    storage is on ``meta`` whatever the tensor's device)."""
    if isinstance(x, torch.Tensor):
        if is_traceable_wrapper_subclass(x):
            for attr in x.__tensor_flatten__()[0]:
                _storages(getattr(x, attr), out)
            return
        if x.layout != torch.strided:
            return
        st = x.untyped_storage()
        out[st._cdata] = (st, x)
    elif isinstance(x, torch.UntypedStorage):
        out.setdefault(x._cdata, (x, x))


_ACTIVE: list = []  # trackers entered and not exited, for the resize_ patch
_ORIGINAL_RESIZE = torch.UntypedStorage.resize_  # the C method, inherited from torch._C.StorageBase


def _tracked_resize_(self: torch.UntypedStorage, size: int):
    """``UntypedStorage.resize_`` while a tracker is active: the resize, then each tracker sees the new size."""
    before = self.nbytes()
    result = _ORIGINAL_RESIZE(self, size)
    for tracker in list(_ACTIVE):
        tracker._resized(self, before, None)
    return result


class DispatchTracer(TorchDispatchMode):
    """Records the storages a program holds while active (see the module doc).

    ``mark``: the current (layer, phase) or None; ``phase``: the iteration's phase ("fwd" / "bwd") stamped on
    events outside layers. ``device_type``: the default selection of ``events``, ``trace()`` and ``peak()``
    (``"cuda"``: the pinned host buffers of the offload techniques are not device memory); None: every device
    (the CPU twin, where host and device memory are one). Every device is recorded either way."""

    def __init__(self, device_type: Optional[str] = None):
        super().__init__()
        self.device_type = device_type
        self.mark: Optional[tuple] = None
        self.phase: Optional[str] = "fwd"
        self.active = False
        self.mark_log: list = []  # (time_us, layer, phase) at every mark change (for the GPU snapshot route)
        self._events: list = []  # every device's events, in order
        self._device_of: dict = {}  # trace id -> device
        self._entries: dict = {}  # storage key -> _Entry, while the storage lives
        self._next = 0
        self._lock = threading.RLock()  # finalizers run in whatever thread frees (autograd, gloo workers)

    # ---- marks and activation ---------------------------------------------------------------------------------
    def set_mark(self, mark: Optional[tuple]) -> None:
        self.mark = mark
        self.mark_log.append((time.time_ns() // 1000, *(mark if mark is not None else (None, None))))

    def __enter__(self):
        self.active = True
        if not _ACTIVE:
            torch.UntypedStorage.resize_ = _tracked_resize_
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        _ACTIVE.remove(self)
        if not _ACTIVE:
            del torch.UntypedStorage.resize_  # the inherited C method again
        return super().__exit__(*exc)

    # ---- recording ----------------------------------------------------------------------------------------------
    def _event(self, op: str, rid: int, size: int) -> None:
        layer, phase = self.mark if self.mark is not None else (None, self.phase)
        self._events.append(Event(op, rid, size, layer, phase))

    def _malloc(self, entry: _Entry, size: int) -> None:
        entry.rid, entry.size = self._next, size
        self._device_of[self._next] = entry.device
        self._next += 1
        if not entry.ignored:
            self._event("malloc", entry.rid, size)

    def _free(self, entry: _Entry) -> None:
        if entry.rid is not None and not entry.ignored:
            self._event("free", entry.rid, entry.size)
        entry.rid = None

    def _entry(self, st: torch.UntypedStorage, owner, counted: bool) -> _Entry:
        """The entry of ``st``, made on first sight with a finalizer; ``counted``: its present bytes are a malloc
        (a storage an op just created), else they predate the tracker and are not counted."""
        key = st._cdata
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(None, st.nbytes(), str(owner.device))
            self._entries[key] = entry
            weakref.finalize(st, self._finalized, key, entry).atexit = False  # nothing to record at exit
            if counted and entry.size > 0 and self.active:
                self._malloc(entry, entry.size)
        return entry

    def _finalized(self, key: int, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
            if self.active:
                self._free(entry)

    def _resized(self, st: torch.UntypedStorage, before: int, owner=None) -> None:
        """``st`` went from ``before`` to its present nbytes (a resize); ``owner``: a tensor on it, if known."""
        after = st.nbytes()
        if after == before or not self.active:
            return
        with self._lock:
            entry = self._entry(st, owner if owner is not None else st, counted=False)
            old = entry.rid
            if after > 0:
                old_entry = _Entry(old, entry.size, entry.device)
                old_entry.ignored = entry.ignored
                self._malloc(entry, after)  # the new bytes exist before the old ones go
                self._free(old_entry)
            else:
                self._free(entry)
            entry.size = after

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs: dict = {}
        for a in tree_leaves((args, kwargs)):
            _storages(a, inputs)
        sizes = {k: st.nbytes() for k, (st, _) in inputs.items()}
        out = func(*args, **kwargs)
        outputs: dict = {}
        for t in tree_leaves(out):
            _storages(t, outputs)
        with self._lock:
            for key, (st, owner) in outputs.items():
                if key not in inputs:  # a storage this op created (or one already tracked)
                    self._entry(st, owner, counted=True)
            for key, (st, owner) in inputs.items():
                if key not in self._entries:
                    self._entry(st, owner, counted=False)  # its device, for a later resize_
                if st.nbytes() != sizes[key]:
                    self._resized(st, sizes[key], owner)
        return out

    def charge(self, device: str, items: list) -> None:
        """Bytes no storage of ours shows, on ``device``: what a kernel holds inside itself while it runs
        (``device/kernel_scratch.py``), ``items`` ``[(nbytes, tag, kept)]`` -- all allocated now, together, and
        freed at once, at the op's moment in the trace (after its outputs), but for the ``kept`` ones, held to the
        end (a workspace made at a first call)."""
        with self._lock:
            if not self.active:
                return
            made = []
            for nbytes, tag, kept in items:
                if nbytes > 0:
                    entry = _Entry(None, nbytes, device)
                    self._malloc(entry, nbytes)
                    self._events[-1].tag = tag
                    made.append((entry, kept))
            for entry, kept in made:
                if not kept:
                    self._free(entry)

    # ---- naming and leaving out ---------------------------------------------------------------------------------
    def _current(self, tensor: torch.Tensor) -> Optional[_Entry]:
        return self._entries.get(storage_id(tensor))

    def request_id(self, tensor: torch.Tensor) -> Optional[int]:
        """The trace id of ``tensor``'s storage now (None: no bytes of it counted now -- created before the tracker
        and never resized since, or resized to 0). A resize gives a storage a new id."""
        entry = self._current(tensor)
        return entry.rid if entry is not None else None

    def tag(self, tensor: torch.Tensor, tag: str) -> None:
        """Name the storage of ``tensor`` (just created under this tracker) as framework buffer ``tag``."""
        entry = self._current(tensor)
        if entry is None or entry.rid is None:
            return
        for e in reversed(self._events):
            if e.id == entry.rid and e.op == "malloc":
                e.tag = tag
                return

    def forget(self, tensor: torch.Tensor) -> None:
        """Leave the storage of ``tensor`` out of the trace (its malloc is removed, its frees and resizes are
        dropped)."""
        entry = self._current(tensor)
        if entry is None or entry.ignored:
            return
        entry.ignored = True
        if entry.rid is not None:
            self._events[:] = [e for e in self._events if e.id != entry.rid]  # in place: ``events`` may be held

    # ---- results --------------------------------------------------------------------------------------------------
    def select(self, device: Optional[str] = None) -> Iterator[Event]:
        """The events of ``device``'s storages (default: ``device_type``), in order."""
        sel = device if device is not None else self.device_type
        return (e for e in self._events if device_matches(self._device_of[e.id], sel))

    @property
    def events(self) -> list:
        """The events of the default selection (``device_type``); with none, the tracker's own list, every device's
        events as they come (its length is the next event's position)."""
        return self._events if self.device_type is None else list(self.select())

    def devices(self) -> list:
        """The devices of every storage recorded, sorted."""
        return sorted(set(self._device_of.values()))

    def live_bytes(self, device: Optional[str] = None) -> int:
        """Bytes of the selected storages alive now (counted ones: created or resized under the tracker)."""
        sel = device if device is not None else self.device_type
        with self._lock:
            return sum(e.size for e in list(self._entries.values())
                       if e.rid is not None and not e.ignored and device_matches(e.device, sel))

    def peak(self, device: Optional[str] = None) -> Peak:
        """The largest live bytes of the selected storages over the events, and when (see ``Peak``)."""
        live, best = 0, Peak(0, -1)
        for n, e in enumerate(self.select(device)):
            live += e.size if e.op == "malloc" else -e.size
            if live > best.bytes:
                best = Peak(live, n, e.layer, e.phase)
        return best

    def trace(self, meta: Optional[dict] = None, device: Optional[str] = None) -> Trace:
        """The selected storages' events as a validated ``Trace`` (``device`` None: ``device_type``)."""
        t = Trace(list(self.select(device)), dict(meta or {}))
        t.validate("captured trace")
        return t
