"""Replay a trace under the policy of PyTorch's CUDA caching allocator, to measure the fragmentation a plan removes.

The policy (c10/cuda/CUDACachingAllocator.cpp, defaults: no ``max_split_size_mb``, no ``expandable_segments``,
one stream):

- sizes rounded up to a multiple of 512 bytes (minimum 512);
- requests <= 1 MiB use the *small* pool, larger ones the *large* pool;
- a request is served by the smallest free cached block of its pool that fits (best fit, ties: lowest address);
- no fit -> a new segment (``cudaMalloc``): 2 MiB for small requests, 20 MiB for requests in (1 MiB, 10 MiB),
  the size rounded up to 2 MiB above;
- the served block is split when the remainder is >= 512 bytes (small pool) or > 1 MiB (large pool);
  the remainder stays cached in the pool;
- a freed block merges with free neighbours of the *same segment*; segments are never merged with each other;
- with a ``capacity`` (device memory), a failed ``cudaMalloc`` first releases every fully free cached segment and
  retries (``empty_cache``-like); if that fails too the request is counted as an OOM and simulated anyway.

``simulate(trace)`` -> ``SimResult``: peak reserved (sum of segment sizes), peak allocated (rounded block sizes),
peak requested (raw sizes), number of segments allocated, OOMs. ``reserved / plan peak`` is the fragmentation
overhead a static plan avoids.

Example: malloc 1.5 MiB (large pool, new 20 MiB segment, split: 1.5 + 18.5), malloc 3 MiB (fits in the 18.5 MiB
remainder, split again), free the first: reserved stays 20 MiB, allocated 3 MiB.
"""
from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass
from typing import Optional

from .trace import Trace

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(n: int) -> int:
    return MIN_BLOCK if n < MIN_BLOCK else -(-n // MIN_BLOCK) * MIN_BLOCK


def allocation_size(n: int) -> int:
    """Segment size ``cudaMalloc``'d for a (rounded) request of ``n`` bytes with no cached fit."""
    if n <= SMALL_SIZE:
        return SMALL_BUFFER
    if n < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-n // ROUND_LARGE) * ROUND_LARGE


class _Block:
    __slots__ = ("addr", "size", "seg", "small", "allocated", "prev", "next")

    def __init__(self, addr, size, seg, small):
        self.addr, self.size, self.seg, self.small = addr, size, seg, small
        self.allocated = False
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


@dataclass
class SimResult:
    peak_reserved_bytes: int
    peak_allocated_bytes: int
    peak_requested_bytes: int
    segments_allocated: int
    segments_released: int
    ooms: int

    def to_json(self) -> dict:
        return asdict(self)


class CachingAllocatorSim:
    """The allocator state; ``malloc(size) -> address``, ``free(address)``."""

    def __init__(self, capacity: Optional[int] = None):
        self.capacity = capacity
        self.pools = {True: [], False: []}  # small? -> sorted [(size, addr, block)]
        self.segments: dict = {}  # seg id -> (head block, size)
        self.by_addr: dict = {}
        self.next_addr = 0
        self.reserved = self.allocated = self.requested = 0
        self.peak = {"reserved": 0, "allocated": 0, "requested": 0}
        self.seg_alloc = self.seg_release = self.ooms = 0

    def _insert(self, b: _Block) -> None:
        bisect.insort(self.pools[b.small], (b.size, b.addr, b))

    def _remove(self, b: _Block) -> None:
        pool = self.pools[b.small]
        i = bisect.bisect_left(pool, (b.size, b.addr))
        del pool[i]

    def _new_segment(self, size: int, small: bool) -> Optional[_Block]:
        if self.capacity is not None and self.reserved + size > self.capacity:
            self.release_free_segments()
            if self.reserved + size > self.capacity:
                self.ooms += 1
        seg = self.seg_alloc
        self.seg_alloc += 1
        b = _Block(self.next_addr, size, seg, small)
        self.next_addr += size
        self.segments[seg] = (b, size)
        self.reserved += size
        return b

    def release_free_segments(self) -> None:
        """Free every cached segment that is one whole free block (what ``empty_cache`` does)."""
        for seg, (head, size) in list(self.segments.items()):
            if not head.allocated and head.next is None and head.size == size:
                self._remove(head)
                del self.segments[seg]
                self.reserved -= size
                self.seg_release += 1

    def malloc(self, nbytes: int) -> int:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            b = pool[i][2]
            del pool[i]
        else:
            b = self._new_segment(allocation_size(size), small)
        remaining = b.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(b.addr + size, remaining, b.seg, small)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._insert(rest)
        b.allocated = True
        self.by_addr[b.addr] = (b, nbytes)
        self.allocated += b.size
        self.requested += nbytes
        self._peaks()
        return b.addr

    def free(self, addr: int) -> None:
        b, nbytes = self.by_addr.pop(addr)
        b.allocated = False
        self.allocated -= b.size
        self.requested -= nbytes
        for nb in (b.prev, b.next):  # merge with free neighbours of the same segment
            if nb is not None and not nb.allocated:
                self._remove(nb)
                if nb is b.prev:
                    nb.size += b.size
                    nb.next = b.next
                    if b.next is not None:
                        b.next.prev = nb
                    b = nb
                else:
                    b.size += nb.size
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
        self._insert(b)

    def _peaks(self) -> None:
        for k, v in (("reserved", self.reserved), ("allocated", self.allocated), ("requested", self.requested)):
            if v > self.peak[k]:
                self.peak[k] = v


def simulate(trace: Trace, capacity: Optional[int] = None) -> SimResult:
    """Replay ``trace`` through the simulator (requests never freed stay allocated to the end)."""
    sim = CachingAllocatorSim(capacity)
    addr: dict = {}
    for e in trace.events:
        if e.op == "malloc":
            addr[e.id] = sim.malloc(e.size)
        else:
            sim.free(addr.pop(e.id))
    return SimResult(sim.peak["reserved"], sim.peak["allocated"], sim.peak["requested"], sim.seg_alloc,
                     sim.seg_release, sim.ooms)
