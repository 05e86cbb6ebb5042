"""DCP storage for a state without values: a rehearsal's fake tensors (``device.has_values`` False), where a save
of Llama3-8B would otherwise write terabytes of nothing. ``sharded_state`` picks these for such a state; everything
around them is the real save and load -- the finite check, the directory, DCP's planning and metadata,
``meta.json``, the checksums, the rename; the load's checks, DCP's load plan, the copies into the model.

``SizeOnlyWriter`` does what ``FileSystemWriter`` does minus the bytes: each piece is staged to the host one at a
time (the writer's own copy of a device tensor, which a real save holds while it writes it), counted, dropped;
DCP's ``.metadata`` is written for real, with every piece's offset and length in the file the real writer would
have made (``__0_0.distcp``, not created). ``SizeOnlyReader`` reads that metadata as data (``DataOnlyReader``) and
copies into each target piece from a host tensor of the piece's size, as ``FileSystemReader`` copies from what it
loaded. Example: a rank's 2 GiB of weights and AdamW states -> ``.metadata`` of a few KiB listing pieces of
``__0_0.distcp`` that add up to 2 GiB (``written_bytes``)."""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from .data_only import DataOnlyReader

SUFFIX = ".distcp"


def _fake_mode(state: dict):
    """The fake mode of the state's tensors (DCP runs outside it: ``sharded_state``)."""
    for v in state.values():
        t = v.to_local() if isinstance(v, DTensor) else v
        if isinstance(t, FakeTensor):
            return t.fake_mode
    return contextlib.nullcontext()


class SizeOnlyWriter(FileSystemWriter):
    def stage(self, state_dict: dict) -> dict:
        """An async save's host copy of the state (``checkpoint.async_save``), made of fake tensors as well: a new
        host tensor per piece, as DCP's stager makes. A piece already on the host (FSDP2's CPU offload) gets its
        new tensor here: the stager's ``deepcopy`` of such a DTensor cannot copy a fake tensor."""
        with _fake_mode(state_dict):
            on_host = {k: v for k, v in state_dict.items() if isinstance(v, DTensor) and v.dim()
                       and v.to_local().device.type == "cpu"}
            staged = super().stage({k: v for k, v in state_dict.items() if k not in on_host})
            staged.update({k: DTensor.from_local(torch.empty_like(v.to_local()), v.device_mesh, v.placements,
                                                 run_check=False, shape=v.shape, stride=v.stride())
                           for k, v in on_host.items()})
        return {k: staged[k] for k in state_dict}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name, offset, results = f"{plan.storage_data.prefix}0{SUFFIX}", 0, []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise ValueError(f"a checkpoint holds tensors only; {item.index.fqn} is not one")
            data = planner.resolve_data(item).detach()
            staged = data if data.device.type == "cpu" else data.to("cpu")  # the writer's host copy of the piece
            n = staged.numel() * staged.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=n,
                                       storage_data=_StorageInfo(relative_path=name, offset=offset, length=n)))
            offset += n
            del staged, data
        done = Future()
        done.set_result(results)
        return done


class SizeOnlyReader(DataOnlyReader):
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        for item in plan.items:
            target = planner.resolve_tensor(item).detach()
            loaded = target.new_empty(tuple(item.lengths), device="cpu")  # as read from its file (a fake one)
            target.copy_(loaded)
            planner.commit_tensor(item, target)
            del loaded
        done = Future()
        done.set_result(None)
        return done


def written_bytes(metadata: Metadata) -> int:
    """The bytes a checkpoint's pieces add up to (what its ``.distcp`` files hold, or would)."""
    return sum(info.length for info in metadata.storage_data.values())
