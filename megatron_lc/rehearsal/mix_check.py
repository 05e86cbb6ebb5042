"""Host and device tensors in one op, as CUDA refuses them. On the stand-in device (``standin.py``) a fake tensor
keeps its device, so an op whose tensors are on the host (``cpu``) and on the device is the op that raises on a GPU
("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"). Fake tensors
raise for most of them, but let a 0-dim host tensor into any op; CUDA lets it only into an elementwise kernel
(TensorIterator: ``x * cpu_scalar``) -- ``torch.stack([device_sum, host_step])`` raises there. ``DeviceMixCheck``
applies CUDA's rule: the op raises ``DeviceMixError`` where CUDA would, and the violation names the op and its site
(the rehearsal stops that rank there, as the GPU run would stop)::

    host and device tensors in one op: aten.stack.default with a [] float32 host tensor beside standin:0 tensors
    at megatron_lc/training/checkpointing/save.py:58 (first_non_finite)

What CUDA accepts and the check lets through: copies between the two (``copy_``, ``to``, ``_foreach_copy_``);
0-dim host tensors read by an elementwise op or a ``_foreach_`` op or as ``masked_fill``'s value; host index
tensors of advanced indexing (``x[idx]``, ``x[idx] = v``: PyTorch moves them to the device). Not seen: an op inside
a C++ kernel of another op (a composite's own steps are seen), ops on a device other than the stand-in.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..device.op_access import site

aten = torch.ops.aten
COPIES = {aten.copy_.default, aten._to_copy.default, aten.copy.default, aten._foreach_copy_.default,
          aten._foreach_copy.default, aten._copy_from.default, aten._copy_from_and_resize.default,
          aten.lift_fresh.default, aten.lift_fresh_copy.default}
SCALAR_VALUE = {aten.masked_fill_.Tensor, aten.masked_fill.Tensor}  # a 0-dim value tensor may stay on the host
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def _written(func, args, kwargs) -> set:
    """ids of the tensors ``func`` writes (its ``Tensor(a!)`` arguments)."""
    out = set()
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            out.update(id(t) for t in tree_leaves(v) if isinstance(t, torch.Tensor))
    return out


def cuda_accepts(func, args, kwargs, host: list) -> bool:
    """Whether CUDA runs ``func`` with these ``host`` tensors beside device ones (module doc)."""
    if func in COPIES:
        return True
    if func in INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        ids = {id(t) for t in tree_leaves(indices) if isinstance(t, torch.Tensor)}
        host = [t for t in host if id(t) not in ids]
        if not host:
            return True
    elementwise = (torch.Tag.pointwise in func.tags or func in SCALAR_VALUE
                   or func.overloadpacket.__name__.startswith("_foreach_"))
    if not elementwise or any(t.dim() != 0 for t in host):
        return False
    written = _written(func, args, kwargs)
    return not any(id(t) in written for t in host)


class DeviceMixError(RuntimeError):
    """An op CUDA would refuse: host and device tensors together (the message names the op and its site)."""


class DeviceMixCheck(TorchDispatchMode):
    """A dispatch mode over the rehearsal (enter it first, under the other checks: they see the op before it
    raises). ``device``: the stand-in (the CPU: nothing to check, host and device are one); ``violations``: one
    dict per (op, site)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.violations: list = []
        self._seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.device.type != "cpu" and not func.is_view and func.namespace == "aten":
            leaves = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
            host = [t for t in leaves if t.device.type == "cpu"]
            if host and any(t.device.type == self.device.type for t in leaves) \
                    and not cuda_accepts(func, args, kwargs, host):
                raise DeviceMixError(self._report(func, host[0], str(site())))
        return func(*args, **kwargs)

    def _report(self, func, t: torch.Tensor, where: str) -> str:
        v = self._seen.get((str(func), where))
        if v is None:
            what = f"a {list(t.shape)} {str(t.dtype).removeprefix('torch.')} host tensor beside {self.device} tensors"
            v = self._seen[(str(func), where)] = {
                "kind": "host and device tensors in one op", "op": str(func), "site": where, "times": 0,
                "buffer": what, "text": f"host and device tensors in one op: {func} with {what} at {where}"}
            self.violations.append(v)
        v["times"] += 1
        return v["text"]
