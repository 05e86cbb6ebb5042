"""What a tensor is when it may be fake (a rehearsal runs the step on fake tensors: shapes, dtypes and devices,
no values, no addresses). ``storage_id``: which storage a tensor lives in, by identity -- the same number for every
view of one storage, another for every other storage alive at the same time; not its address (fake storages all
report ``data_ptr() == 0``). ``has_values``: whether a value may be read at all."""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor


def storage_id(t: torch.Tensor) -> int:
    """``t``'s storage (its ``StorageImpl``). Like an address, it may be reused once that storage is freed."""
    return t.untyped_storage()._cdata


def has_values(t: torch.Tensor) -> bool:
    """False for a fake tensor: a branch on its value cannot be taken, a rehearsal takes the branch its mock data
    would (said where it does)."""
    return not isinstance(t, FakeTensor)
