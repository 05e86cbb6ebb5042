"""Device/host buffers of the FPDT block: accounting, offload to host, double-buffered prefetch, all-to-all.

Everything goes through ``device.DeviceAdapter`` (pinned host buffers, a device-to-host and a host-to-device side
stream, events); on CPU the same code runs with real, synchronous copies. Every device buffer the block creates is
acquired/released in a ``device.BufferAccount`` under one of these tags, so "device-resident bytes" is the
framework's own accounting (on CPU host and device are one memory; the figure stands for what a GPU would hold)::

    fpdt.proj        local q, k, v of the chunk being projected (before the all-to-all)
    fpdt.a2a         all-to-all send/receive buffers and layout copies (transient)
    fpdt.chunk       current gathered q/k/v chunk (forward); dq of the finished chunk, dk/dv accumulators (backward)
    fpdt.acc         fp32 output / lse accumulators of the q chunk (forward); one block's dq/dk/dv (backward)
    fpdt.fetch_kv    k/v chunks fetched back from host (double buffer: the one in use and the next)
    fpdt.fetch_q     q/out/dout/lse/dq chunks fetched back from host in the backward (double buffer)
    fpdt.saved       chunks kept on the device for later (only without offload)
    fpdt.proj_saved  what the chunk projection's autograd graph saved, when it lives on the device
    fpdt.grad_local  a finished chunk's dq/dk/dv after the all-to-all back (projection backward input)

Host side: every parked chunk is a view of the model's ``device.HostPool`` (one pinned allocation, sized before
training by ``host_share.py``); ``host_account`` counts the pool bytes the blocks hold (tag ``fpdt.host``, each view
rounded up to ``HostPool.ALIGN`` as in the pool), so its peak is what the pool must hold.

Not counted: kernels' internal workspace (flash-attention keeps O(chunk) temporaries), the online-softmax merge's
temporaries, and the block's input/output tensors (same size for every chunk count, reported separately).

GPU ordering rules followed (never executed here, no GPU): a side stream waits on an event of the compute stream
before it touches a tensor the compute stream produced or a buffer it allocated; a copy's source is marked with
``record_stream`` so the allocator keeps it until the copy ran; the compute stream waits on a fetch's event before use.
A fetch reads only host blocks, so it waits on no compute: its device buffers are allocated on the prefetch stream
(the caching allocator's pool of that stream, whose blocks no compute kernel may still read) and declared to the
compute stream when it takes them (``wait``). Only planned arena slots, whose bytes held other buffers, make the
prefetch stream wait for the compute stream first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ...device import BufferAccount, DeviceAdapter, HostPool
from ...parallel.collectives import all_to_all
from ...parallel.topology import Axis, Topology


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Hosted:
    """A host copy (a view of the host pool) and the event of the latest copy into or out of it (None on CPU).

    ``fresh``: an accumulator never written yet -- its host bytes are undefined and its first fetch is a device
    buffer zeroed on the device, not a copy (see ``ChunkStore.put_accumulator``)."""

    host: torch.Tensor
    done: object = None
    fresh: bool = False
    counted: bool = True  # in ``host_account`` (not while the pool measures: a probe's graph may be abandoned)


@dataclass
class Pending:
    """Tensors fetched (or about to be) to the device; ``owned`` ones are released by ``FPDTBuffers.release``."""

    tensors: list
    event: object = None
    owned: list = field(default_factory=list)


class FPDTBuffers:
    """Accounting + transfers for one device; shared by the FPDT blocks of a model (see ``runtime.FPDTRuntime``)."""

    def __init__(self, device: torch.device, account: BufferAccount, host_account: BufferAccount, arena,
                 pool: HostPool):
        self.device, self.account, self.host_account, self.arena = device, account, host_account, arena
        self.dev = DeviceAdapter.for_device(device)
        self.pool = pool
        pool.bind(self.dev)
        self.d2h, self.h2d = self.dev.copy_streams()

    # ---- accounting ----------------------------------------------------------------------------------------
    def track(self, tag: str, *ts: Optional[torch.Tensor]) -> None:
        for t in ts:
            if t is not None:
                self.account.acquire(tag, nbytes(t))

    def untrack(self, tag: str, *ts: Optional[torch.Tensor]) -> None:
        for t in ts:
            if t is not None:
                self.account.release(tag, nbytes(t))

    def zeros(self, tag: str, shape, dtype) -> torch.Tensor:
        t = self.arena.buffer(tag, shape, dtype, device=self.device).zero_()  # planned slot (memory.plan)
        self.track(tag, t)
        return t

    def _record_stream(self, t: torch.Tensor, stream) -> None:
        self.dev.record_stream(t, stream)  # caching-allocator memory
        self.arena.record_stream(t, stream)  # planned arena memory (memory.plan)

    # ---- host copies ---------------------------------------------------------------------------------------
    def host_block(self, shape, dtype) -> Hosted:
        """A block of the host pool (contents undefined), counted under ``fpdt.host``."""
        counted = not self.pool.measuring_now
        if counted:
            self.host_account.acquire("fpdt.host", HostPool.block_bytes(shape, dtype))
        return Hosted(self.pool.take(shape, dtype), counted=counted)

    def to_host(self, t: torch.Tensor, into: Optional[Hosted] = None) -> Hosted:
        """Copy ``t`` to a (pinned) host block on the d2h stream; the caller may drop ``t`` right after."""
        dev = self.dev
        h = into if into is not None else self.host_block(t.shape, t.dtype)
        h.fresh = False
        dev.wait_event(dev.record_event(), self.d2h)  # the copy starts after the producer of t
        with dev.stream(self.d2h):
            h.host.copy_(t, non_blocking=True)
        self._record_stream(t, self.d2h)  # t's memory is not reused before the copy ran
        h.done = dev.record_event(self.d2h)
        return h

    def drop_host(self, h: Hosted) -> None:
        """Give a host block back to the pool, once its latest copy (``h.done``) has run."""
        if h.counted:
            self.host_account.release("fpdt.host", HostPool.block_bytes(h.host.shape, h.host.dtype))
        self.pool.give(h.host, after=h.done)

    def fetch(self, hosted: list, tag: str) -> Pending:
        """Issue host-to-device copies of ``hosted`` into fresh device buffers (accounted under ``tag``); a fresh
        accumulator is zeroed on the device instead (its host block was never written)."""
        dev = self.dev
        if self.arena.planned:  # a planned slot may hold bytes a compute kernel still reads
            bufs = [self.arena.buffer(tag, h.host.shape, h.host.dtype, device=self.device) for h in hosted]
            dev.wait_event(dev.record_event(), self.h2d)
        else:  # the prefetch stream's own pool: nothing on the compute stream to wait for
            with dev.stream(self.h2d):
                bufs = [self.arena.buffer(tag, h.host.shape, h.host.dtype, device=self.device) for h in hosted]
        self.track(tag, *bufs)
        for h, b in zip(hosted, bufs):
            if h.fresh:
                b.zero_()  # compute stream: ordered before every use of b
                continue
            if h.done is not None:
                dev.wait_event(h.done, self.h2d)  # the host copy is complete
            with dev.stream(self.h2d):
                b.copy_(h.host, non_blocking=True)
            self._record_stream(b, self.h2d)  # written on the side stream: not reused before that copy ran
        done = dev.record_event(self.h2d)
        for h in hosted:
            if not h.fresh:
                h.done = done  # the block is read until this event: not handed out again before it
        return Pending(bufs, done, [(tag, b) for b in bufs])

    def wait(self, p: Pending) -> list:
        """The fetched tensors, after the compute stream waited for their copies; declared to the compute stream
        (made on the prefetch stream, they are not reused before what the compute stream queues on them ran)."""
        if p.event is not None:
            self.dev.wait_event(p.event)
            for t in p.tensors:
                self._record_stream(t, self.dev.current_stream())
        return p.tensors

    def release(self, p: Optional[Pending]) -> None:
        if p is None:
            return
        for tag, t in p.owned:
            self.untrack(tag, t)
        p.owned, p.tensors = [], []

    def retag(self, p: Pending, t: torch.Tensor, tag: str) -> None:
        """Move ``t`` out of ``p`` (it outlives the others) and account it under ``tag``."""
        for i, (old, b) in enumerate(p.owned):
            if b is t:
                self.untrack(old, b)
                p.owned.pop(i)
                break
        self.track(tag, t)

    # ---- all-to-all ------------------------------------------------------------------------------------------
    def a2a(self, t: torch.Tensor, topo: Topology, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """``collectives.all_to_all`` over the Ulysses axis; its send and receive buffers counted as transient."""
        if topo.size(Axis.ULYSSES) == 1:
            return t
        self.account.acquire("fpdt.a2a", 2 * nbytes(t))
        out = all_to_all(t, topo, Axis.ULYSSES, scatter_dim, gather_dim)
        self.account.release("fpdt.a2a", 2 * nbytes(t))
        return out


class ChunkStore:
    """Per-chunk tensors kept for later, keyed like ``("k", 3)``: on the host (offload) or on the device.

    Offload: ``put`` copies to host (the caller then drops the device tensor), ``prefetch`` issues the copies back
    into fresh device buffers (counted under the given tag), ``FPDTBuffers.wait`` makes the compute stream wait,
    ``FPDTBuffers.release`` frees them.
    No offload: the device tensor itself is kept (``fpdt.saved``) and prefetch/wait return it without copies."""

    def __init__(self, bufs: FPDTBuffers, offload: bool):
        self.bufs, self.offload = bufs, offload
        self.items: dict = {}

    def put(self, key, t: torch.Tensor) -> None:
        if self.offload:
            self.items[key] = self.bufs.to_host(t)
        else:
            self.items[key] = t
            self.bufs.track("fpdt.saved", t)

    def put_accumulator(self, key, shape, dtype) -> None:
        """An accumulator that starts at zero. Offloading: a host block that is *not* zeroed (no host memset of
        the fp32 dq chunks every step, no copy of zeros): it is marked fresh, its first fetch is a device buffer
        zeroed on the device, and its first ``write_back`` makes the host bytes valid. No device memory until
        fetched. Without offload: device zeros (``fpdt.saved``)."""
        if self.offload:
            h = self.items[key] = self.bufs.host_block(shape, dtype)
            h.fresh = True
        else:
            self.items[key] = self.bufs.zeros("fpdt.saved", shape, dtype)

    def prefetch(self, keys: list, tag: str) -> Pending:
        if self.offload:
            return self.bufs.fetch([self.items[k] for k in keys], tag)
        return Pending([self.items[k] for k in keys])

    def write_back(self, key, t: torch.Tensor) -> None:
        """After an in-place update of a fetched accumulator: copy it back to its host buffer (no-op on device)."""
        if self.offload:
            self.bufs.to_host(t, into=self.items[key])

    def drop(self, *keys) -> None:
        for key in keys:
            item = self.items.pop(key)
            if self.offload:
                self.bufs.drop_host(item)
            else:
                self.bufs.untrack("fpdt.saved", item)

    def clear(self) -> None:
        self.drop(*list(self.items))
