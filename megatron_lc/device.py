"""Device adapter: the few GPU-only things the memory techniques need (pinned host buffers, side streams, events),
behind one interface with a CPU twin. The memory code (FPDT offload, Memo rounding buffers) is written once against
``DeviceAdapter``; the tests run the CPU twin, where copies are real and synchronous.

    dev = DeviceAdapter.for_device(torch.device("cpu"))
    host = dev.host_empty((1024, 64), torch.float32)      # pinned on CUDA, plain on CPU
    offload, prefetch = dev.copy_streams()                # the device's two copy streams, shared
    with dev.stream(offload):
        host.copy_(x, non_blocking=True)
    ev = dev.record_event(offload)                         # later: dev.wait_event(ev) before reusing x

The CUDA side (``_CudaAdapter``) is a direct mapping to ``torch.cuda`` calls and was never executed here (no GPU).

``BufferAccount`` is the framework's own accounting of the device buffers it creates (chunk buffers, rounding
buffers, arena views): benchmarks report its peak as "device-resident bytes by accounting". On CPU, host and device
are the same memory, so this accounting -- not RSS -- is the figure that stands for GPU memory.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
import torch


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuStream:
    """A CPU twin's stream: a name only (work is synchronous), so that which stream is which can be tested."""

    def __init__(self, name: str):
        self.name = name


_COPY_STREAMS: dict = {}  # device -> (offload stream, prefetch stream), shared by every technique on it


class DeviceAdapter:
    """CPU twin: streams are no-ops (work is synchronous), events are always complete."""

    def __init__(self, device: torch.device):
        self.device = device

    def copy_streams(self) -> tuple:
        """The device's one offload (device -> host) and one prefetch (host -> device) stream, shared by FPDT and
        Memo: each copy direction has one engine, and separate streams per technique alias in CUDA's pool."""
        key = (self.device.type, self.device.index)
        if key not in _COPY_STREAMS:
            _COPY_STREAMS[key] = (self._copy_stream("offload"), self._copy_stream("prefetch"))
        return _COPY_STREAMS[key]

    def _copy_stream(self, name: str):
        return _CpuStream(name)

    @staticmethod
    def for_device(device: torch.device) -> "DeviceAdapter":
        return _CudaAdapter(device) if device.type == "cuda" else DeviceAdapter(device)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu")

    def new_stream(self):
        return None

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    def record_event(self, stream=None):
        return _CpuEvent()

    def wait_event(self, event, stream=None) -> None:
        """Make ``stream`` (default: the compute stream) wait for ``event``."""
        return None

    def wait_stream(self, stream, other) -> None:
        return None

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Tell the allocator ``tensor`` is used on ``stream`` (so it is not freed before that work ends)."""
        return None

    def synchronize(self) -> None:
        return None


class _CudaAdapter(DeviceAdapter):
    """CUDA mapping (never executed in this project's CI: no GPU)."""

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def _copy_stream(self, name: str):
        return self.new_stream()

    def stream(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_event(self, stream=None):
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait_event(self, event, stream=None) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def wait_stream(self, stream, other) -> None:
        stream.wait_stream(other)

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        if stream is not None:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class BufferAccount:
    """Bytes of framework-created device buffers, by tag, with the running peak.

    ``acquire(tag, tensor)`` / ``release(tag, tensor)`` around a buffer's life; ``peak`` is the maximum of the sum
    over tags. ``reset_peak()`` starts a new measurement."""

    def __init__(self) -> None:
        self.live: dict = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_by_tag: dict = defaultdict(int)

    @staticmethod
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def acquire(self, tag: str, t_or_bytes) -> None:
        n = t_or_bytes if isinstance(t_or_bytes, int) else self.nbytes(t_or_bytes)
        self.live[tag] += n
        self.current += n
        self.peak = max(self.peak, self.current)
        self.peak_by_tag[tag] = max(self.peak_by_tag[tag], self.live[tag])

    def release(self, tag: str, t_or_bytes) -> None:
        n = t_or_bytes if isinstance(t_or_bytes, int) else self.nbytes(t_or_bytes)
        self.live[tag] -= n
        self.current -= n

    def reset_peak(self) -> None:
        self.peak = self.current
        self.peak_by_tag = defaultdict(int, self.live)

    def summary(self) -> dict:
        return {"current_bytes": self.current, "peak_bytes": self.peak, "peak_by_tag": dict(self.peak_by_tag)}
