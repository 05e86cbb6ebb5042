"""What an op does to memory, and where in our code it came from -- for the stream-order check
(``stream_check.py``), which sees every op through ``OpAccesses``, a dispatch mode:

- the tensor arguments an op mutates (``copy_``'s ``self``, ``out=``) are writes, the other tensor arguments
  reads, and a tensor it returns on a storage none of its arguments had is a new allocation it wrote (allocated
  only, for ``empty`` and its kin);
- views (``view``, ``slice``, ``detach``...), metadata ops (``t_``, ``set_``, ``prim.device``...) touch no bytes;
- ``extent(t)``: the bytes of its storage a tensor covers (a strided view: from its first to its last element);
- ``site()``: the first frame inside ``megatron_lc/`` (other than this module, ``stream_check.py``, the adapter and
  other dispatch modes), e.g. ``megatron_lc/memory/memo/runtime.py:212 (_fetch)``; outside our code (a test), the
  first frame outside torch.

Example: ``host[:n].copy_(buf[:n], non_blocking=True)`` reaches the mode as ``aten.copy_.default`` with
``used = [(host[:n], True), (buf[:n], False)]`` and ``made = []``.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .storage import has_values, storage_id

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../megatron_lc
_ROOT = os.path.dirname(_PKG)
_HERE = os.path.dirname(os.path.abspath(__file__))
_SELF = {os.path.join(_HERE, f) for f in ("op_access.py", "stream_check.py", "adapter.py")}
_SKIP = (os.path.dirname(os.path.abspath(torch.__file__)), os.path.dirname(contextlib.__file__))


@dataclass(frozen=True)
class Site:
    """Where an access happened."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


_KIND: dict = {}  # code object -> (2: ours, 1: outside torch (a test), 0: torch, this checking, a mode; its path)


def site() -> Site:
    f, fallback = sys._getframe(1), None
    while f is not None:
        code = f.f_code
        kind = _KIND.get(code)
        if kind is None:
            path = os.path.abspath(code.co_filename)
            kind = _KIND[code] = (0 if path in _SELF or path.startswith(_SKIP) or code.co_name == "__torch_dispatch__"
                                  else 2 if path.startswith(_PKG + os.sep) else 1, os.path.relpath(path, _ROOT))
        if kind[0] == 2:
            return Site(kind[1], f.f_lineno, code.co_name)
        if kind[0] == 1 and fallback is None:
            fallback = Site(kind[1], f.f_lineno, code.co_name)
        f = f.f_back
    return fallback or Site("?", 0, "?")


ALLOCATE = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
            torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
            torch.ops.aten.new_empty_strided.default}
_IGNORE = {torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset,
           torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default, torch.ops.aten.resize_.default,
           torch.ops.aten.record_stream.default, torch.ops.aten.lift_fresh.default}
_METADATA = {"t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "detach_", "swapaxes_", "swapdims_",
             "resize_as_", "requires_grad_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
             "is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense"}


def tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from tensors(x)


def has_storage(t: torch.Tensor) -> bool:
    """A plain, parameter or fake tensor (a wrapper subclass such as DTensor is seen through its inner ops)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)


def is_fake(t: torch.Tensor) -> bool:
    """No values, so no address either (``meta`` tensors are alike)."""
    return not has_values(t) or t.device.type == "meta"


def extent(t: torch.Tensor) -> tuple:
    """Byte range ``[lo, hi)`` of ``t``'s elements in its storage."""
    es = t.element_size()
    last = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.storage_offset() * es, (last + 1) * es


def blocking_copy(func, args, kwargs) -> bool:
    """Whether ``func`` is a copy the host waits for (``x.to("cpu")``, ``host.copy_(x)``: no ``non_blocking``)."""
    if func is torch.ops.aten._to_copy.default:
        return not kwargs.get("non_blocking", False)
    if func is torch.ops.aten.copy_.default:
        return not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    return False


class OpAccesses(TorchDispatchMode):
    """Runs every op and hands ``on_op(func, used, made, blocking)`` what it touched: ``used`` the
    ``(tensor, written)`` arguments, ``made`` the tensors on new storages it returned, ``blocking`` whether it is a
    copy the host waits for (``blocking_copy``)."""

    def __init__(self, on_op):
        super().__init__()
        self.on_op = on_op

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view or func in _IGNORE or func.namespace == "prim" or func.overloadpacket.__name__ in _METADATA:
            return func(*args, **kwargs)
        used = []
        if func not in ALLOCATE:
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
                written = a.alias_info is not None and a.alias_info.is_write
                used.extend((t, written) for t in tensors(v) if t.numel() > 0 and has_storage(t))
        out = func(*args, **kwargs)
        inputs = {storage_id(t) for t, _ in used}
        made = [t for t in tensors(out) if t.numel() > 0 and has_storage(t) and storage_id(t) not in inputs]
        self.on_op(func, used, made, blocking_copy(func, args, kwargs))
        return out
