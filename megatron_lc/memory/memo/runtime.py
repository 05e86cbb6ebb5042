"""Memo's rounding buffers, host copies and their schedule (the Memo paper's sections 4.1 and 4.3.4, Figures 6 and
11): ``MemoRuntime``, the run-time state the model context holds for the layers' executors.

Two device buffers, allocated before training, hold the skeletal tensors of the layer being computed: layer i uses
buffer ``i % 2``. Example, 6 layers (layers 4 and 5 are the last two: never swapped)::

    forward   layer:  0    1    2    3    4    5
              buffer: b0   b1   b0   b1   b0   b1
              after layer i, buffer i%2 -> host[i] on the offload stream (event e_i), while layer i+1 computes;
              layer i+2 waits for e_i before it writes buffer i%2. Layers 4, 5 stay in their buffers.
    backward  layer:  5    4    3    2    1    0
              when layer i's backward starts, buffer (i-1)%2 is free (layer i+1 is done): host[i-1] -> buffer
              (i-1)%2 on the prefetch stream while layer i computes; layer i-1 waits for that event.

The buffers are sized and allocated by the calibration before training (``profiler.py``: the exact bytes one layer
places at the chosen alpha); a layer that would place more is an error, never a buffer that grows mid-step. The
host copies come from the model's ``device.HostPool``: ``allocate`` reserves one buffer's capacity per swapped layer
(``host_bytes()`` is exactly that reservation), and each swapped layer takes its copy at its first forward.

On CPU (``DeviceAdapter`` twin) streams are no-ops and copies synchronous, so the same code runs here; on CUDA the
host tensors are pinned and the copies asynchronous (never executed in this project: no GPU).

``MemoRuntime`` also carries the per-layer counters (``stats()``) and the framework's accounting of these device
buffers (``account``, a ``BufferAccount``: tags ``memo.rounding``, ``memo.recompute``, ``memo.kept``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...device import BufferAccount, DeviceAdapter, HostPool
from .profiler import calibrate_memo
from .slots import ALIGN, SkeletalSlot


class RoundingBuffer:
    """One device byte buffer; ``alloc`` hands out aligned regions from the start after each ``reset``."""

    def __init__(self, index: int, nbytes: int, device: torch.device, account: BufferAccount):
        self.index, self.device, self.account = index, device, account
        self.data = torch.empty(nbytes, dtype=torch.uint8, device=device)
        account.acquire("memo.rounding", nbytes)
        self.cursor = 0
        self.owner: Optional[SkeletalSlot] = None  # the slot whose bytes are (or are being copied) in the buffer
        self.offload_event = None  # copy of the owner's bytes to host still in flight

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def reset(self) -> None:
        self.cursor = 0

    def alloc(self, nbytes: int, layer: int) -> int:
        off = self.cursor
        end = off + (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if end > self.capacity:
            raise RuntimeError(f"memo: rounding buffer {self.index} ({self.capacity} bytes, sized by the calibration) "
                               f"cannot hold layer {layer}'s skeletal tensors ({end} bytes placed so far): this step's "
                               f"layer shape differs from the calibrated one (data.seq_length x micro_batch_size)")
        self.cursor = end
        return off

    def check_owner(self, slot: SkeletalSlot) -> None:
        if self.owner is not slot:
            held = "nothing" if self.owner is None else f"layer {self.owner.layer} (forward #{self.owner.generation})"
            raise RuntimeError(f"rounding buffer {self.index} holds {held} but layer {slot.layer} (forward "
                               f"#{slot.generation}) needs it: Memo offload runs one forward then its backward "
                               f"(no second forward before the backward)")


class MemoRuntime:
    """State shared by the layers of one model: buffers, host copies, events, slots of the current step.

    ``offload=False`` is plain token-wise recompute (``recompute_granularity: full``): kept tensors stay on the
    device by reference, no buffer, no host copy. ``alpha`` is the fraction of tokens of the ``other`` skeletal
    tensors kept (offloaded) rather than recomputed; it is 0 without offload. ``pool``: where the host copies come
    from (the model context's, shared with FPDT; a fresh one if None)."""

    TAG = "memo"  # its share of the host pool

    def __init__(self, num_layers: int, offload: bool, alpha: float = 0.0, measure: bool = False,
                 device: Optional[torch.device] = None, pool: Optional[HostPool] = None,
                 chunk_tokens: Optional[int] = None):
        self.n = num_layers
        self.chunk_tokens = chunk_tokens  # memory.layer_chunk_size: mini-sequences of the dropped tokens (steps.py)
        self.measure = measure  # calibration probe: count bytes by kind, copy nothing
        self.alpha = alpha if offload else 0.0  # offload: set by the calibration (``profiler.py``)
        self.offload = offload
        self.account = BufferAccount()
        self.pool = pool if pool is not None else HostPool()
        self.buffers: list = [None, None]
        self.buffer_bytes = 0  # each rounding buffer's capacity, set by the calibration (``size_for``)
        self.host: dict = {}  # layer -> host byte tensor (a view of the pool, one buffer's capacity)
        self.host_owner: dict = {}  # layer -> slot whose bytes are in host[layer]
        self.slots: dict = {}  # layer -> slot of the latest forward
        self.fetch_events: dict = {}  # id(slot) -> event of its prefetch
        self.generation = 0
        self.attn_forward_calls = 0  # counts core attention forwards (recompute must never add any)
        self.rope_split = None  # (key, RoPE tables of the kept and dropped tokens): executor.rope_parts' cache
        self.profile = self.alpha_result = None  # what the calibration measured and solved (offload)
        self.device = self.dev = self.offload_stream = self.prefetch_stream = None
        if device is not None:
            self.bind(device)

    def bind(self, device: torch.device) -> None:
        """The device the layers run on: its copy streams (done by the calibration, before the first forward)."""
        self.device = device
        self.dev = DeviceAdapter.for_device(device)
        self.offload_stream, self.prefetch_stream = self.dev.copy_streams()
        if not self.measure:
            self.pool.bind(self.dev)

    # ---- setup ---------------------------------------------------------------------------------------------
    def swapped(self, layer: int) -> bool:
        """Memo does not swap the last two layers: their backward follows their forward at once."""
        return self.offload and layer < self.n - 2

    def kept_tokens(self, s: int) -> int:
        """Tokens of every ``other`` skeletal tensor kept (offloaded): floor(alpha * s)."""
        return int(self.alpha * s + 1e-9) if self.offload else 0

    def capacity(self, nbytes: int) -> int:
        """A rounding buffer's bytes for ``nbytes`` placed: rounded up to ``HostPool.ALIGN`` (a multiple of
        ``slots.ALIGN``), so a host copy of a whole buffer is one pool block, with no padding of its own."""
        return max(HostPool.ALIGN, HostPool.aligned(nbytes))

    def host_need(self, nbytes: int) -> int:
        """Pool bytes of the host copies for buffers sized for ``nbytes``: one buffer per swapped layer."""
        return sum(self.swapped(i) for i in range(self.n)) * self.capacity(nbytes)

    def probe(self, alpha: float, device: torch.device) -> "MemoRuntime":
        """A measuring twin (nothing placed or copied; bytes counted by kind) for the calibration's probes."""
        return type(self)(num_layers=3, offload=True, alpha=alpha, measure=True, device=device)

    def size_for(self, nbytes: int) -> None:
        """Rounding buffers of ``capacity(nbytes)`` each (allocated by ``allocate``) and the pool reservation of the
        host copies: what the calibration measured one layer to place."""
        self.buffer_bytes = self.capacity(nbytes)
        self.pool.reserve(self.TAG, self.host_need(nbytes))

    # ---- a technique runtime (compose/context.py): bind (above), calibrate, allocate -----------------------
    def calibrate(self, model, env) -> None:
        """With offload: layer 0 profiled, alpha solved, buffers and host share sized (``profiler.py``)."""
        calibrate_memo(model, self, env)

    def allocate(self) -> None:
        """The two rounding buffers on the device, of the calibrated size (nothing without offload)."""
        if not self.buffer_bytes:
            return
        for b in range(2):
            if self.buffers[b] is not None:
                self.account.release("memo.rounding", self.buffers[b].capacity)
            self.buffers[b] = RoundingBuffer(b, self.buffer_bytes, self.device, self.account)

    def host_bytes(self) -> int:
        return sum(h.numel() for h in self.host.values())

    # ---- forward -------------------------------------------------------------------------------------------
    def new_slot(self, layer: int, refs: set) -> SkeletalSlot:
        """The slot of ``layer``'s forward; with offload it places into buffer ``layer % 2`` from now on."""
        if layer == 0:
            self.generation += 1
        slot = SkeletalSlot(layer, "measure" if self.measure else "rounding" if self.offload else "device", refs)
        slot.generation = self.generation
        self.slots[layer] = slot
        if slot.mode == "rounding":
            if self.buffers[0] is None:
                raise RuntimeError("memo offload: the rounding buffers were not allocated; calibrate the model "
                                   "(MemoRuntime.calibrate, then allocate) before its first forward")
            buf = self.buffers[layer % 2]
            if buf.offload_event is not None:  # layer i-2's bytes must have left before we overwrite them
                self.dev.wait_event(buf.offload_event)
                buf.offload_event = None
            slot.begin(buf)
            buf.owner = slot
        return slot

    def after_forward(self, slot: SkeletalSlot) -> None:
        """Layer forward done: start the copy of buffer ``layer % 2`` to host (swapped layers)."""
        slot.flush()
        if self.measure:
            return
        if not self.offload:
            self.account.acquire("memo.kept", sum(slot.stats.bytes.values()))
            return
        buf = slot.buffer
        slot.used = buf.cursor
        if not self.swapped(slot.layer):
            return
        host = self.host.get(slot.layer)
        if host is None:  # a whole buffer's capacity: later steps never place more (``RoundingBuffer.alloc``)
            host = self.host[slot.layer] = self.pool.take((buf.capacity,), torch.uint8)
        ready = self.dev.record_event()
        with self.dev.stream(self.offload_stream):
            self.dev.wait_event(ready, self.offload_stream)
            host[:buf.cursor].copy_(buf.data[:buf.cursor], non_blocking=True)
            buf.offload_event = self.dev.record_event(self.offload_stream)
        self.host_owner[slot.layer] = slot
        slot.stats.bytes_to_host += sum(slot.stats.bytes.values())

    # ---- backward ------------------------------------------------------------------------------------------
    def _fetch(self, slot: SkeletalSlot, stream) -> None:
        """Copy ``slot``'s bytes from host into buffer ``layer % 2`` on ``stream`` (records the event)."""
        if self.host_owner.get(slot.layer) is not slot:
            raise RuntimeError(f"host copy of layer {slot.layer} was overwritten by a later forward: Memo offload "
                               f"runs one forward then its backward")
        buf = self.buffers[slot.layer % 2]
        ready = self.dev.record_event()  # the compute stream is done with the buffer's previous owner
        with self.dev.stream(stream):
            self.dev.wait_event(ready, stream)
            buf.data[:slot.used].copy_(self.host[slot.layer][:slot.used], non_blocking=True)
            self.fetch_events[id(slot)] = self.dev.record_event(stream)
        buf.owner = slot
        slot.buffer = buf
        slot.stats.bytes_from_host += sum(slot.stats.bytes.values())

    def before_backward(self, slot: SkeletalSlot) -> None:
        """Layer ``slot.layer``'s backward starts: make its bytes resident, prefetch the layer below."""
        if not self.offload:
            return
        self.ensure_resident(slot)
        below = self.slots.get(slot.layer - 1)
        if below is not None and below.generation == slot.generation and self.swapped(below.layer) \
                and id(below) not in self.fetch_events:
            self._fetch(below, self.prefetch_stream)

    def ensure_resident(self, slot: SkeletalSlot) -> None:
        if not self.offload:
            return
        buf = self.buffers[slot.layer % 2]
        if buf.owner is not slot and self.swapped(slot.layer):
            self._fetch(slot, self.prefetch_stream)
        ev = self.fetch_events.pop(id(slot), None)
        if ev is not None:
            self.dev.wait_event(ev)
        buf.check_owner(slot)

    def layer_backward_done(self, slot: SkeletalSlot) -> None:
        if not self.offload and not getattr(slot, "released", False):
            self.account.release("memo.kept", sum(slot.stats.bytes.values()))
            slot.released = True

    # ---- counters ------------------------------------------------------------------------------------------
    def stats(self) -> list[dict]:
        """Per-layer counters of the latest forward/backward (bytes by kind, tokens kept/recomputed, host bytes)."""
        out = []
        for layer in sorted(self.slots):
            s = self.slots[layer].stats
            out.append({"layer": layer, "swapped": self.swapped(layer), "tokens": s.tokens,
                        "tokens_kept": s.tokens_kept, "tokens_recomputed": s.tokens_recomputed,
                        "bytes_input": s.bytes["input"], "bytes_attn": s.bytes["attn"], "bytes_lse": s.bytes["lse"],
                        "bytes_other_kept": s.bytes["other"], "bytes_other_recomputed": s.bytes_recomputed,
                        "bytes_to_host": s.bytes_to_host, "bytes_from_host": s.bytes_from_host})
        return out
