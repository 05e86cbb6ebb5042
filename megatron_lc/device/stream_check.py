"""``StreamCheck``: a ``DeviceAdapter`` that does the CPU twin's work (copies real and synchronous) and checks, beside
it, the order a GPU would run it in -- the races no CPU run can show, because on the CPU every copy is done before the
next line runs.

It keeps the streams (the compute stream, the two copy streams, any new ones, and the host thread) as vector clocks:
every op queued on a stream takes the next position there; ``record_event(s)`` captures what ``s`` has reached,
``wait_event(ev, s2)`` makes ``s2`` pass it, ``synchronize`` / ``ev.synchronize()`` / a value read (``.item()``)
make the host pass it, and work the host queues later starts after everything the host has passed. A dispatch mode
sees every op: its tensor arguments are reads, the arguments it mutates and the tensors it makes are writes, on the
current stream (``stream(s)`` switches; an op on host tensors only runs on the host). Per buffer -- an allocation,
found by address for real tensors (so the arena's views land in the arena's one allocation) and by storage identity
for fake ones (every fake storage has address 0) -- it keeps the last accesses to each byte range, and reports:

- ``read before its write's event``: a read on stream A of bytes written on stream B that A has not waited past
  (a prefetch used before its event was waited on);
- ``overwritten while read`` / ``overwritten while written``: a write on A of bytes another stream read or wrote
  that A has not waited past (a rounding buffer, double buffer, host pool block or arena block reused before its
  reader's event);
- ``freed while in use``: a device allocation freed while a stream other than the one it was allocated on has used
  it, neither declared with ``record_stream`` nor waited past by the allocating stream (the caching allocator could
  hand the memory out again under the running copy).

Events do not complete by themselves: ``query()`` is True only once the host passed the event, so ``HostPool`` keeps a
block given back ``after=event`` until then. Each violation names the buffer (the range, shape and dtype accessed,
the allocation's size, kind and site) and both sites (the first frame inside ``megatron_lc/`` of each)::

    with StreamCheck(torch.device("cpu")) as check:   # the adapter for_device returns, and the dispatch mode
        trainer = Trainer(cfg, Topology())            # build inside: runtimes keep the adapter they bound to
        trainer.train()
    assert not check.violations, check.report()

Under ``FakeTensorMode`` enter the check inside the fake mode (``with FakeTensorMode(): with StreamCheck(d): ...``)
so its dispatch mode sees the fake tensors. Not checked: NCCL's own streams (a collective is one op on the current
stream), the caching allocator's own reuse beyond ``record_stream``, ops inside tensor subclasses (DTensor) below the
wrapper, and byte ranges are a view's extent (a strided view covers the gaps between its elements).
"""
from __future__ import annotations

import bisect
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from .adapter import DeviceAdapter, use_adapter
from .op_access import ALLOCATE, OpAccesses, Site, extent, has_storage, is_fake, site
from .storage import storage_id


class _Stream:
    """A stream (or the host thread): ``clock`` positions queued so far; ``vec[s]``: the position of ``s`` this
    stream has passed (its own included)."""

    def __init__(self, name: str):
        self.name, self.clock, self.vec, self.host_seen = name, 0, {}, -1

    def __repr__(self) -> str:
        return f"stream {self.name!r}"


def _merge(dst: dict, src: dict) -> None:
    for s, p in src.items():
        if dst.get(s, 0) < p:
            dst[s] = p


class _Event:
    """What ``stream`` had reached when recorded. Complete (``query``) only once the host passed it."""

    def __init__(self, check: "StreamCheck", stream: _Stream, at: Site):
        self.check, self.stream, self.vec, self.site = check, stream, dict(stream.vec), at
        self.pos = stream.clock

    def query(self) -> bool:
        return self.check.host.vec.get(self.stream, 0) >= self.pos

    def synchronize(self) -> None:
        self.check._host_passes(self.vec)


@dataclass
class _Access:
    write: bool
    stream: _Stream
    pos: int
    lo: int
    hi: int
    site: Site
    what: str  # shape and dtype of the tensor accessed


@dataclass
class _Buffer:
    """One allocation: ``ptr`` (0 for a fake storage), ``nbytes``, where and on which stream it was made."""

    ptr: int
    nbytes: int
    stream: _Stream
    site: Site
    host: bool = False
    recorded: set = field(default_factory=set)  # streams named by record_stream
    accesses: list = field(default_factory=list)
    limit: int = 256  # prune ``accesses`` when they grow past this (then twice what is left)

    def name(self, acc: _Access) -> str:
        where = "host" if self.host else "device"
        return (f"{acc.what} at bytes [{acc.lo}, {acc.hi}) of the {self.nbytes}-byte {where} buffer allocated at "
                f"{self.site}")


@dataclass(frozen=True)
class StreamViolation:
    """One ordering error: ``kind``, the buffer, the earlier access (``first``) and the one that races it."""

    kind: str
    buffer: str
    first: Site
    first_stream: str
    second: Site
    second_stream: str

    def __str__(self) -> str:
        if self.kind == "freed while in use":
            return (f"{self.kind}: {self.buffer} is freed at {self.second} into the {self.second_stream} stream's "
                    f"pool, but the {self.first_stream} stream's use at {self.first} was neither declared "
                    f"(record_stream) nor waited past by the {self.second_stream} stream")
        verb = "reads" if self.kind == "read before its write's event" else "writes"
        earlier = "read" if self.kind == "overwritten while read" else "write"
        return (f"{self.kind}: the {self.second_stream} stream {verb} {self.buffer} at {self.second}, but the "
                f"{self.first_stream} stream's {earlier} at {self.first} was not waited past (no wait on an event "
                f"recorded after it)")


class StreamCheck(DeviceAdapter):
    """The CPU twin plus the stream-order check (module docstring). ``violations``: what it found, in order (each
    kind and pair of sites once); ``report()``: one line each."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        super().__init__(torch.device(device))
        self.host, self.compute = _Stream("host"), _Stream("compute")
        self.streams = [self.host, self.compute]
        self._current = [self.compute]
        self._copy = None
        self._spans: list = []  # (ptr, end, buffer) of real allocations, sorted by ptr
        self._fake: dict = {}  # storage_id -> buffer, fake (or address-0) storages
        self.violations: list = []
        self._reported: set = set()
        self.ops = 0
        self._stack: Optional[contextlib.ExitStack] = None

    # ---- installing --------------------------------------------------------------------------------------------
    def __enter__(self) -> "StreamCheck":
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(use_adapter(self))
        self._stack.enter_context(OpAccesses(self.op))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def report(self) -> str:
        return "\n".join(str(v) for v in self.violations) or "stream order: no violations"

    # ---- the adapter -------------------------------------------------------------------------------------------
    @property
    def current(self) -> _Stream:
        return self._current[-1]

    def copy_streams(self) -> tuple:
        if self._copy is None:
            self._copy = (self.new_stream("offload"), self.new_stream("prefetch"))
        return self._copy

    def new_stream(self, name: Optional[str] = None) -> _Stream:
        s = _Stream(name or f"side{len(self.streams) - 1}")
        self.streams.append(s)
        return s

    def current_stream(self) -> _Stream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return self._mark_host(super().host_empty(shape, dtype))

    def host_pinned(self, nbytes: int) -> torch.Tensor:
        return self._mark_host(super().host_pinned(nbytes))

    def record_event(self, stream=None) -> _Event:
        s = stream if stream is not None else self.current
        self._sync_host(s)
        return _Event(self, s, site())

    def wait_event(self, event, stream=None) -> None:
        s = stream if stream is not None else self.current
        self._sync_host(s)
        _merge(s.vec, event.vec)

    def wait_stream(self, stream, other) -> None:
        self._sync_host(stream)
        _merge(stream.vec, other.vec)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is None or not has_storage(tensor):
            return
        buf, _, own = self.locate(tensor)
        if own:  # a view of another allocation (an arena block) is not the caching allocator's to keep
            buf.recorded.add(stream)

    def synchronize(self) -> None:
        for s in self.streams:
            self._host_passes(s.vec)

    # ---- ops ------------------------------------------------------------------------------------------------------
    def op(self, func, used: list, made: list, blocking: bool = False) -> None:
        """One op (``op_access.OpAccesses``): on the host when it touches and makes host buffers only (a CPU
        tensor beside another device: ``torch.arange`` on the host), else on the current stream, and a ``blocking``
        copy between the two makes the host wait for that stream (``x.to("cpu")``); its reads and writes
        checked, its new tensors allocations made there."""
        located = [(t, written, self.locate(t)) for t, written in used]
        on_host = [loc[0].host for _, _, loc in located] + [self._on_host(t) for t in made]
        stream = self.host if on_host and all(on_host) else self.current
        self.enqueue(stream)
        at = site() if located or made else None
        for t, written, loc in located:
            self.access(loc, t, written, stream, at)
        for t in made:
            loc = self.locate(t, stream=stream, at=at, host=stream is self.host)
            if func not in ALLOCATE:
                self.access(loc, t, True, stream, at)
        read = func is torch.ops.aten._local_scalar_dense.default
        if stream is not self.host and (read or blocking and any(on_host)):
            self._host_passes(stream.vec)  # a value read (.item()) or a copy to or from the host waits for its stream

    # ---- clocks ------------------------------------------------------------------------------------------------
    def _host_passes(self, vec: dict) -> None:
        _merge(self.host.vec, vec)
        self.host.clock += 1  # a new host position: what it queues from now on is after what it passed
        self.host.vec[self.host] = self.host.clock

    def _sync_host(self, s: _Stream) -> None:
        """Work the host queues on ``s`` starts after everything the host did or passed."""
        if s is not self.host and s.host_seen != self.host.clock:
            _merge(s.vec, self.host.vec)
            s.host_seen = self.host.clock

    def enqueue(self, s: _Stream) -> None:
        self._sync_host(s)
        s.clock += 1
        s.vec[s] = s.clock
        self.ops += 1

    def _passed(self, s: _Stream, acc: _Access) -> bool:
        return acc.stream is s or s.vec.get(acc.stream, 0) >= acc.pos

    # ---- buffers -----------------------------------------------------------------------------------------------
    def _mark_host(self, t: torch.Tensor) -> torch.Tensor:
        self.locate(t, at=site(), host=True)[0].host = True
        return t

    def locate(self, t: torch.Tensor, stream: Optional[_Stream] = None, at: Optional[Site] = None,
               host: bool = False) -> tuple:
        """(buffer, byte offset of ``t``'s storage in it, whether the storage is the buffer's own); a storage seen
        for the first time is a new buffer made on ``stream`` (default: the current one) at ``at``."""
        st = t.untyped_storage()
        ptr = 0 if is_fake(t) or st.nbytes() == 0 else st.data_ptr()
        if ptr == 0:
            key = storage_id(t)
            buf = self._fake.get(key)
            if buf is None:
                buf = self._fake[key] = self._new(st, 0, stream, at, host or self._on_host(t), key)
            return buf, 0, True
        i = bisect.bisect_right(self._spans, ptr, key=lambda e: e[0]) - 1
        if i >= 0 and ptr < self._spans[i][1]:
            buf = self._spans[i][2]
            return buf, ptr - buf.ptr, ptr == buf.ptr and st.nbytes() == buf.nbytes
        buf = self._new(st, ptr, stream, at, host or self._on_host(t), None)
        bisect.insort(self._spans, (ptr, ptr + max(st.nbytes(), 1), buf), key=lambda e: e[0])
        return buf, 0, True

    def _on_host(self, t: torch.Tensor) -> bool:
        """A CPU tensor is on the host when the device is not the CPU (the CPU twin knows host buffers only by the
        adapter's ``host_pinned`` / ``host_empty``)."""
        return self.device.type != "cpu" and t.device.type == "cpu"

    def _new(self, st, ptr: int, stream, at, host: bool, key) -> _Buffer:
        buf = _Buffer(ptr, st.nbytes(), stream or self.current, at or site(), host)
        fin = weakref.finalize(st, self._freed, buf, key)
        fin.atexit = False
        return buf

    def _freed(self, buf: _Buffer, key) -> None:
        """The allocation died: its memory goes back to the allocating stream's pool, free for that stream's next
        request at once -- every other stream's use must be recorded (``record_stream``) or waited past."""
        if key is None:
            i = bisect.bisect_left(self._spans, buf.ptr, key=lambda e: e[0])
            while i < len(self._spans) and self._spans[i][0] == buf.ptr:
                if self._spans[i][2] is buf:
                    self._spans.pop(i)
                    break
                i += 1
        else:
            self._fake.pop(key, None)
        if buf.host:
            return
        alloc = buf.stream
        self._sync_host(alloc)
        at = None
        for acc in buf.accesses:
            if acc.stream not in buf.recorded and not self._passed(alloc, acc):
                at = at or site()
                self._report("freed while in use", buf, acc, at, alloc)
        buf.accesses = []

    def access(self, loc: tuple, t: torch.Tensor, write: bool, stream: _Stream, at: Site) -> None:
        """Check one read or write of ``t`` (located at ``loc``) on ``stream`` against the buffer's earlier
        accesses to overlapping bytes, then record it."""
        buf, base, _ = loc
        lo, hi = extent(t)
        lo, hi = lo + base, hi + base
        keep = []
        for acc in buf.accesses:
            if acc.hi <= lo or hi <= acc.lo:
                keep.append(acc)
                continue
            if (write or acc.write) and not self._passed(stream, acc):
                kind = ("overwritten while written" if acc.write else "overwritten while read") if write else \
                    "read before its write's event"
                self._report(kind, buf, acc, at, stream, _Access(write, stream, 0, lo, hi, at, _what(t)))
            covered = lo <= acc.lo and acc.hi <= hi
            if not (covered and (write or (acc.stream is stream and not acc.write))):
                keep.append(acc)  # a later access is checked against this one as well
        keep.append(_Access(write, stream, stream.clock, lo, hi, at, _what(t)))
        if len(keep) > buf.limit:  # accesses every stream has passed can race nothing any more
            for s in self.streams:
                self._sync_host(s)
            keep = [a for a in keep if not all(self._passed(s, a) for s in self.streams)]
            buf.limit = max(256, 2 * len(keep))
        buf.accesses = keep

    def _report(self, kind: str, buf: _Buffer, first: _Access, second: Site, stream: _Stream,
                now: Optional[_Access] = None) -> None:
        key = (kind, first.site, second, first.stream.name, stream.name)
        if key in self._reported:
            return
        self._reported.add(key)
        self.violations.append(StreamViolation(kind, buf.name(now or first), first.site, first.stream.name,
                                               second, stream.name))


def _what(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
