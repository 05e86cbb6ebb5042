"""FPDT's technique runtime: the run-time state of a model's FPDT blocks that the model context holds, and the
steps setup runs it by (``compose/context.py``)."""
from __future__ import annotations

from typing import Optional

import torch

from ...device import BufferAccount, HostPool
from .buffers import FPDTBuffers
from .host_share import calibrate_fpdt


class FPDTRuntime:
    """Run-time state of a model's FPDT blocks, shared by all its layers and returned in the model's context:
    the device and host byte accounts and, per device, one ``FPDTBuffers`` (so one pair of copy streams).

    ``arena``: where framework buffers come from -- anything with ``buffer(tag, shape, dtype, device=...)`` and
    ``record_stream(t, stream)`` (``memory.arena``'s handle: plain allocations until a memory plan is installed).
    ``pool``: the host pool the parked chunks come from (the model context's, shared with Memo; a fresh one if
    None), sized by ``host_share.py``.

    A technique runtime (``compose/context.py``): ``bind`` (nothing: each device's buffers bind on first use),
    ``calibrate`` (one block's parked chunks measured, the pool's ``fpdt`` share reserved), ``allocate`` (nothing:
    chunk buffers come from the arena as the blocks run)."""

    TAG = "fpdt"

    def __init__(self, arena, pool: Optional[HostPool] = None):
        self.arena = arena
        self.pool = pool if pool is not None else HostPool()
        self.account = BufferAccount()  # device-resident bytes of the blocks' buffers
        self.host_account = BufferAccount()  # pool bytes parked on the host
        self._by_device: dict = {}

    def bind(self, device: torch.device) -> None:
        pass

    def calibrate(self, model, env) -> None:
        calibrate_fpdt(model, env)

    def allocate(self) -> None:
        pass

    def buffers(self, device: torch.device) -> FPDTBuffers:
        if device not in self._by_device:
            self._by_device[device] = FPDTBuffers(device, self.account, self.host_account, self.arena, self.pool)
        return self._by_device[device]
