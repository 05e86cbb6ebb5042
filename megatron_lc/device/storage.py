"""Which storage a tensor lives in, by identity: the same number for every view of one storage, another for every
other storage alive at the same time. Not its address: the storages of fake tensors (a rehearsal) all report
``data_ptr() == 0``, and a tensor of zero bytes has no address at all."""
from __future__ import annotations

import torch


def storage_id(t: torch.Tensor) -> int:
    """``t``'s storage (its ``StorageImpl``). Like an address, it may be reused once that storage is freed."""
    return t.untyped_storage()._cdata
