"""Host memory used as if it were the device's. On a GPU the offload techniques' host memory (the host pool: Memo's
host copies, FPDT's parked chunks, host checkpoints) is only ever copied to or from the device; an op that computes
with it -- a norm reading a host checkpoint that was never copied back, a matmul on a parked chunk -- fails there
(a device mismatch), or with a CPU stand-in silently computes on the host. On the rehearsal's stand-in device such an
op also mixes host and device tensors (``mix_check.py`` stops the rank there); ``HostMathCheck`` reports, before it,
any op whose arguments include the host pool's allocation -- told apart by identity -- other than a copy or a view,
also an op on the pool alone (host math where device math was meant), naming the op and its site (the first frame
inside ``megatron_lc/``)::

    host pool used in device math: aten.rms_norm.default on a [64, 1, 256] float32 view of the host pool
    at megatron_lc/memory/checkpoint_offload.py:148

Host tensors other than the pool are ``mix_check.py``'s.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..device import storage_id
from ..device.op_access import site

aten = torch.ops.aten
COPIES = {aten.copy_.default, aten._to_copy.default, aten.copy.default}
METADATA = {torch.ops.prim.device.default, aten.sym_size.default, aten.sym_size.int, aten.sym_stride.default,
            aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default, aten.is_pinned.default}


class HostMathCheck(TorchDispatchMode):
    """A dispatch mode over the step; ``pools``: the host pools whose allocation is host memory."""

    def __init__(self, pools):
        super().__init__()
        self.pools = list(pools)
        self.violations: list = []  # one per (op, site), with how many times it happened
        self._seen: dict = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in COPIES and func not in METADATA and not func.is_view:
            host = {storage_id(p.data) for p in self.pools if p.data is not None}
            if host:
                for a in tree_leaves((args, kwargs)):
                    if isinstance(a, torch.Tensor) and a.layout == torch.strided and storage_id(a) in host:
                        self._report(func, a, str(site()))  # (here: site() skips dispatch modes)
                        break
        return func(*args, **kwargs)

    def _report(self, func, a: torch.Tensor, where: str) -> None:
        v = self._seen.get((str(func), where))
        if v is None:
            v = self._seen[(str(func), where)] = {
                "kind": "host pool used in device math", "op": str(func), "site": where, "times": 0,
                "buffer": f"a {list(a.shape)} {str(a.dtype).removeprefix('torch.')} view of the host pool"}
            self.violations.append(v)
        v["times"] += 1
