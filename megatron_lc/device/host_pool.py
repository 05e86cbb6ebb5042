"""``HostPool``: the offload techniques' host memory, one allocation per model (so per device), sized up front by
the calibrations, counted exactly (no power-of-two rounding: PyTorch's pinned allocator rounds every
``pin_memory=True`` block up to a power of two, so the pool page-locks a plain allocation instead)."""
from __future__ import annotations

import bisect
import contextlib
import math
import weakref
from typing import Optional

import torch

from ..units import fmt_bytes
from .adapter import DeviceAdapter
from .storage import storage_id


class HostPoolError(RuntimeError):
    """A host pool request that does not fit (or a pool used before it was sized)."""


class _FirstFit:
    """First-fit placement of byte blocks in ``[0, capacity)`` (``capacity`` None: unbounded, a measurement).

    ``gaps``: the free ranges ``[start, end)`` sorted by start, coalesced on ``free``; ``high``: the largest end
    ever handed out (the bytes the blocks needed, holes included)."""

    def __init__(self, capacity: Optional[int]):
        self.capacity = capacity
        self.gaps: list = [[0, capacity if capacity is not None else float("inf")]]
        self.live: dict = {}  # start -> size
        self.high = 0

    def alloc(self, size: int) -> Optional[int]:
        for i, (start, end) in enumerate(self.gaps):
            if end - start >= size:
                if end - start == size:
                    self.gaps.pop(i)
                else:
                    self.gaps[i][0] = start + size
                self.live[start] = size
                self.high = max(self.high, start + size)
                return start
        return None

    def free(self, start: int) -> None:
        size = self.live.pop(start)
        i = bisect.bisect_left([g[0] for g in self.gaps], start)
        self.gaps.insert(i, [start, start + size])
        if i + 1 < len(self.gaps) and self.gaps[i][1] == self.gaps[i + 1][0]:  # merge with the next gap
            self.gaps[i][1] = self.gaps.pop(i + 1)[1]
        if i > 0 and self.gaps[i - 1][1] == self.gaps[i][0]:  # and with the previous one
            self.gaps[i - 1][1] = self.gaps.pop(i)[1]

    @property
    def used(self) -> int:
        return sum(self.live.values())


class HostPool:
    """The host memory of the offload techniques of one model (Memo's host copies, FPDT's parked chunks): ONE
    allocation on the device's host -- pinned on CUDA (``DeviceAdapter.host_pinned``: exact bytes, no power-of-two
    rounding), plain on the CPU twin -- sized up front, from which typed views are handed out and given back.

    Life: the calibrations ``reserve(tag, nbytes)`` what each technique will hold at most (FPDT: one layer's parked
    chunks measured, times the layers, plus one backward's accumulators; Memo: its swapped layers times the rounding
    buffer); ``size`` is their exact sum and is what the host budget is compared with. ``allocate`` -- called by setup
    once every calibration has reserved (a refused page-lock is one line there, not a rank failing in its first
    forward while the others wait for it), else by the first ``take`` -- allocates ``size`` bytes once (a
    ``reserve`` after that is an error); a request that does not fit is a ``HostPoolError``
    naming the numbers, never a fresh allocation beside the pool. Every view starts on a multiple of ``ALIGN``.

    Example (``ALIGN`` = 512)::

        pool = HostPool()
        pool.bind(DeviceAdapter.for_device(torch.device("cpu")))
        pool.reserve("fpdt", 2048)                          # size 2048 bytes
        a = pool.take((100,), torch.float32)                # 400 bytes at offset 0 (block of 512)
        b = pool.take((10, 10), torch.bfloat16)             # 200 bytes at offset 512
        pool.give(a)                                        # [0, 512) free again
        c = pool.take((256,), torch.float32)                # 1024 bytes: first fit at offset 1024
        pool.take((1024,), torch.uint8)                     # HostPoolError: 1024 bytes asked, 1536 used of 2048

    ``give(t, after=event)``: the block's last copy (a side-stream event, None on CPU) may still be in flight. Its
    range is free for placement at once -- so blocks land where the CPU twin (whose events are complete at once) puts
    them, whatever the copies' timing, and a pool sized on the CPU does not fragment on a GPU -- and a ``take`` that
    lands on it waits for the event first (the host synchronizes with that copy).

    ``measuring()``: while calibrations probe a layer, ``take`` returns plain tensors and the same first-fit runs on
    an unbounded range; the context's ``high`` is the bytes those probes would need in the pool."""

    ALIGN = 512

    def __init__(self) -> None:
        self.reserved: dict = {}  # tag -> bytes
        self.beside: dict = {}  # tag -> bytes the run holds on the host outside the pool, budgeted with it (``hold``)
        self.dev: Optional["DeviceAdapter"] = None
        self.data: Optional[torch.Tensor] = None  # the one allocation (uint8, ``size`` bytes)
        self.fit: Optional[_FirstFit] = None
        self.pending: list = []  # (start, end, event): given back, a copy may still use the range
        self._measure: Optional[_FirstFit] = None
        self._measured: dict = {}  # id(tensor) -> (weak ref, measuring fit, start): plain tensors of ``measuring``

    @classmethod
    def aligned(cls, nbytes: int) -> int:
        return -(-int(nbytes) // cls.ALIGN) * cls.ALIGN

    @classmethod
    def block_bytes(cls, shape, dtype) -> int:
        """Bytes a view of ``shape`` / ``dtype`` takes in the pool (rounded up to ``ALIGN``)."""
        return cls.aligned(math.prod(shape) * torch.empty((), dtype=dtype).element_size())

    @property
    def size(self) -> int:
        return sum(self.reserved.values())

    @property
    def budget_bytes(self) -> int:
        """What the host budget is compared with: the pool and what is held beside it."""
        return self.size + sum(self.beside.values())

    def others_than(self, tag: str) -> int:
        """The budgeted bytes of everything but ``tag``'s share (what Memo's alpha LP must leave room for)."""
        return self.budget_bytes - self.reserved.get(tag, 0)

    def hold(self, tag: str, nbytes: int) -> None:
        """Host memory the run holds outside the pool, counted with it against the budget (and so in Memo's alpha
        LP): the asynchronous checkpoint's pinned staging area, which torch.distributed.checkpoint's stager owns."""
        self.beside[tag] = int(nbytes)

    def bind(self, dev: "DeviceAdapter") -> None:
        """The device whose host memory this is (pinned for it on CUDA); one device per pool."""
        if self.dev is not None and self.dev.device != dev.device:
            raise HostPoolError(f"host pool: bound to {self.dev.device}, cannot serve {dev.device} too (one pool per "
                                f"device)")
        self.dev = self.dev or dev

    def reserve(self, tag: str, nbytes: int) -> None:
        """Set ``tag``'s share of the pool (replacing an earlier one), before the pool is allocated."""
        if self.data is not None:
            raise HostPoolError(f"host pool: {tag} reserves {nbytes} bytes after the pool was allocated "
                                f"({self.size} bytes: {self.reserved}); every calibration runs before the first step")
        self.reserved[tag] = self.aligned(nbytes)

    def allocate(self) -> None:
        if self.data is not None:
            return
        if self.size == 0:
            raise HostPoolError("host pool: nothing was reserved -- the offload techniques size the pool in their "
                                "runtimes' calibrate (training/setup.py) before the first step")
        if self.dev is None:  # never bound: the host of the CPU twin
            self.dev = DeviceAdapter(torch.device("cpu"))
        try:
            self.data = self.dev.host_pinned(self.size)
        except (RuntimeError, OSError) as e:  # cudaHostRegister refused, or the host has not the memory
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise HostPoolError(f"host pool: could not allocate and page-lock {fmt_bytes(self.size)} of host memory "
                                f"({self.reserved}) for {self.dev.device}: {why}") from None
        self.fit = _FirstFit(self.size)

    @contextlib.contextmanager
    def measuring(self):
        """Plain tensors for ``take`` inside; yields the first-fit whose ``high`` counts what they would need."""
        outer, self._measure = self._measure, _FirstFit(None)
        try:
            yield self._measure
        finally:
            self._measure = outer

    def take(self, shape, dtype) -> torch.Tensor:
        """A view ``shape`` / ``dtype`` of the pool (contents undefined)."""
        n = self.block_bytes(shape, dtype)
        if self._measure is not None:
            t = torch.empty(shape, dtype=dtype)
            self._measured = {k: v for k, v in self._measured.items() if v[0]() is not None}  # drop dead tensors
            self._measured[id(t)] = (weakref.ref(t), self._measure, self._measure.alloc(n))
            return t
        self.allocate()
        start = self.fit.alloc(n)
        if start is None:
            raise HostPoolError(
                f"host pool: {math.prod(shape) * torch.empty((), dtype=dtype).element_size()} bytes asked "
                f"({tuple(shape)} {dtype}, {n} aligned), {self.fit.used} in use of {self.size} (reserved: "
                f"{self.reserved}; largest free range {max((e - s for s, e in self.fit.gaps), default=0)}): "
                f"the step holds more than its calibration measured (another shape than data.seq_length x "
                f"micro_batch_size, or a forward whose backward never ran still holds its chunks)")
        self._wait_for_copies(start, start + n)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.data[start:start + nbytes].view(dtype).view(shape)

    def give(self, t: torch.Tensor, after=None) -> None:
        """Return ``t`` (a view from ``take``); ``after``: the event of the last copy that uses it, or None."""
        entry = self._measured.get(id(t))
        if entry is not None and entry[0]() is t:
            del self._measured[id(t)]
            entry[1].free(entry[2])
            return
        # the block's byte offset in the pool, by storage (a fake tensor has no address: data_ptr() is 0)
        mine = self.data is not None and storage_id(t) == storage_id(self.data)
        start = t.storage_offset() * t.element_size() - self.data.storage_offset() if mine else -1
        if self.fit is None or start not in self.fit.live:
            raise HostPoolError(f"host pool: the tensor {tuple(t.shape)} {t.dtype} given back is not a block of this "
                                f"pool")
        end = start + self.fit.live[start]
        self.fit.free(start)
        if after is not None and not after.query():
            self.pending.append((start, end, after))

    def _wait_for_copies(self, lo: int, hi: int) -> None:
        """Before ``[lo, hi)`` is handed out: wait for the copies still using given-back blocks there (and forget
        the finished ones)."""
        keep = []
        for start, end, ev in self.pending:
            if start < hi and lo < end:
                ev.synchronize()
            elif not ev.query():
                keep.append((start, end, ev))
        self.pending = keep

    @property
    def measuring_now(self) -> bool:
        return self._measure is not None

    @property
    def used(self) -> int:
        return self.fit.used if self.fit is not None else 0

    @property
    def high(self) -> int:
        """The largest offset any block reached since allocation (equals ``size`` when the sizing was tight)."""
        return self.fit.high if self.fit is not None else 0
