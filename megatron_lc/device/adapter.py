"""``DeviceAdapter``: the few GPU-only things the memory techniques need (pinned host memory, side streams, events),
behind one interface with a CPU twin, where copies are real and synchronous, streams are names and events are always
complete. The CUDA side (``_CudaAdapter``) is a direct mapping to ``torch.cuda`` calls and was never executed here
(no GPU).

Which adapter a run gets is decided by ``DeviceAdapter.for_device``, called once by each technique runtime when it
binds to its device. ``use_adapter(a)`` makes it return ``a`` instead, for ``a``'s device type, while the context
is open (the stream-order check of a rehearsal, ``stream_check.StreamCheck``, installs itself this way)::

    with use_adapter(adapter):
        trainer = Trainer(cfg, topo)          # Memo, FPDT, the host checkpoints and the arena bind to ``adapter``
    trainer.train()                           # ... and keep it
"""
from __future__ import annotations

import contextlib
import weakref

import torch


class _CpuEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_INSTALLED: list = []  # adapters chosen by ``use_adapter``, innermost last


@contextlib.contextmanager
def use_adapter(adapter: "DeviceAdapter"):
    """``DeviceAdapter.for_device(d)`` returns ``adapter`` inside, for every ``d`` of its device type (and index,
    where both name one). Runtimes keep the adapter they bound to, so build the model inside."""
    _INSTALLED.append(adapter)
    try:
        yield adapter
    finally:
        _INSTALLED.remove(adapter)


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
        """The adapter of ``device``: the innermost one ``use_adapter`` installed for it, else CUDA's mapping or the
        CPU twin."""
        device = torch.device(device)
        for a in reversed(_INSTALLED):
            if a.device.type == device.type and None in (a.device.index, device.index) \
                    or a.device == device:
                return a
        return _CudaAdapter(device) if device.type == "cuda" else DeviceAdapter(device)

    def host_empty(self, shape, dtype) -> torch.Tensor:
        """A host tensor from PyTorch's pinned allocator on CUDA (rounded up to a power of two; the copy test's
        pinned-vs-pageable comparison), plain on CPU. The offload techniques use ``HostPool`` instead."""
        return torch.empty(shape, dtype=dtype, device="cpu")

    def host_pinned(self, nbytes: int) -> torch.Tensor:
        """Exactly ``nbytes`` of host memory as one uint8 tensor, page-locked on CUDA (plain here)."""
        return torch.empty(int(nbytes), dtype=torch.uint8, device="cpu")

    def new_stream(self):
        return None

    def current_stream(self):
        """The stream work is queued on now (the compute stream outside ``stream``); None on the CPU twin."""
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


def _host_unregister(storage, ptr: int) -> None:
    """Unlock pages ``cudaHostRegister`` locked (``storage``: kept alive until then)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


class _CudaAdapter(DeviceAdapter):
    """CUDA mapping (never executed in this project's CI: no GPU)."""

    def host_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)

    def host_pinned(self, nbytes: int) -> torch.Tensor:
        # pin_memory=True would round the block up to a power of two (CachingHostAllocator: PowerOf2Ceil, even with
        # pinned_use_cuda_host_register): page-lock exactly these bytes of a plain allocation instead (as PyTorch's
        # own checkpoint stager does, torch/cuda/_pin_memory_utils.py), and unlock them when the tensor goes -- the
        # finalizer holds the storage, so the pages are unlocked before they are freed
        t = torch.empty(int(nbytes), dtype=torch.uint8, device="cpu")
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
        weakref.finalize(t, _host_unregister, t.untyped_storage(), t.data_ptr())
        return t

    def new_stream(self):
        return torch.cuda.Stream(device=self.device)

    def _copy_stream(self, name: str):
        return self.new_stream()

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

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
