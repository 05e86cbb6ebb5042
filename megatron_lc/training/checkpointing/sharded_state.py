"""The training state as ``torch.distributed.checkpoint`` (DCP) stores it: every tensor under a key that names no
layout, with its full shape; each rank hands DCP the pieces it holds, and DCP reads back whatever pieces a rank of
another layout needs. So a checkpoint saved at one (tp, cp, dp, ZeRO-1 or not) loads at any other.

Keys (flat, so parameter names with dots stay whole)::

    model/<param>                          the weight
    optim/<param>/exp_avg, .../exp_avg_sq  AdamW moments (the parameter's shape and partition)
    optim/<param>/step                     AdamW's step count (a scalar)

A tensor-parallel parameter is a DTensor on the tp group, ``Shard`` on its partition dim. SwiGLU's ``fc1`` is
partitioned with stride 2 (its full weight is ``[gate; up]``, each tp rank holding its slice of both): it is stored as
``[2, ffn, hidden]``, sharded on dim 1. Example, ffn 8, hidden 4, tp=2: rank 0 holds gate rows 0-3 and up rows 0-3
(local ``[8, 4]`` viewed ``[2, 4, 4]``), rank 1 rows 4-7 of each; the checkpoint holds one ``[2, 8, 4]`` tensor, and a
tp=1 run reads it into its ``[16, 4]`` weight viewed ``[2, 8, 4]``. Replicated tensors (norms, the replicas of dp and
cp) are written once (DCP deduplicates equal pieces).

Under FSDP2 (``parallel/fsdp.py``) a parameter is also cut over dp x cp, on a dim other than its tp partition:
its shard is stored as a DTensor on the 2-D (tp, dp x cp) mesh, ``Shard`` on both dims, so the checkpoint holds
the same full tensors and loads at any layout, with or without FSDP. Example, ``fc2`` ``[hidden 4, ffn 8]``
(partition dim 1), tp=2, dp=2: rank (tp 0, dp 1) holds rows 2-3 of columns 0-3 -- ``[Shard(1), Shard(0)]``.

The optimizer part comes from the optimizer that steps this rank's parameters: AdamW's state, or under ZeRO-1 the
local optimizer of the parameters this rank owns -- after a load each rank asks for the states of the parameters it
owns in the new layout, so ZeRO-1 states move to another dp x cp, and between ZeRO-1 and plain AdamW.

An MoE layer's experts under expert parallelism are a DTensor on the expert group, ``Shard(0)`` (each expert rank
holds ``E/ep`` experts), under FSDP2 on the 2-D (expert, expert-data) mesh, ``Shard(0)`` twice; the checkpoint
holds the ``[E, ...]`` tensor, for any ep.

In a rehearsal (fake tensors: no values) the same calls run with ``size_only.py``'s storage, each simulated rank
alone (the fake process group answers no collective), and DCP's planning outside the fake mode: it computes a
DTensor's offsets with index tensors it reads (``torch.arange``), which must be real; the state's fake tensors
stay fake.
"""
from __future__ import annotations

import contextlib
import warnings
from concurrent.futures import Future
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ...config import Config
from ...device import has_values
from ...parallel.collectives import fake_world
from ...parallel.expert_parallel import is_expert
from ...parallel.tensor_parallel import tp_partition
from ...parallel.topology import Axis, Topology
from .data_only import DataOnlyReader, torch_types_only
from .reshard import parameter_shapes
from .size_only import SizeOnlyReader, SizeOnlyWriter

MOMENTS = ("exp_avg", "exp_avg_sq")


def stored_view(t: torch.Tensor, partition: Optional[tuple]) -> tuple[torch.Tensor, Optional[int]]:
    """(``t`` as stored, the dim its tp pieces are cut along or None). ``partition = (dim, stride)``: a stride above 1
    splits ``dim`` into ``(stride, size / stride)`` and the pieces are cut along the second."""
    if partition is None:
        return t, None
    dim, stride = partition
    if stride == 1:
        return t, dim
    shape = t.shape
    return t.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1:]), dim + 1


def local_optimizer(opt):
    """The optimizer whose ``state`` holds this rank's AdamW states (ZeRO-1's local one, or ``opt``)."""
    return opt.optim if type(opt).__name__ == "ZeroRedundancyOptimizer" else opt


class ShardedState:
    """Builds the DCP state dicts of one model on one topology (see module doc)."""

    def __init__(self, model, topo: Topology):
        self.model, self.topo = model, topo
        self.names = {id(p): n for n, p in model.named_parameters()}
        self._meshes: dict = {}  # (groups, device type) -> DeviceMesh

    def _mesh(self, groups: tuple, device_type: str, grid: Optional[list] = None,
              names: tuple = ("tp", "dp_cp")) -> DeviceMesh:
        """The mesh of ``groups`` (one per dim) for tensors on ``device_type``, made once. A stored piece's mesh has
        its own device's type: ``DTensor.from_local`` moves a piece to its mesh's device type, so FSDP2's host
        shards (CPU offload; FSDP's own mesh is the GPU's) on the GPU's mesh would be copies in device memory -- a
        save would stage the whole state there, and a load would fill the copies, not the shards. Example, tp=2
        dp=2 with CPU offload: fc2's host shard goes on a ``cpu`` (tp, dp x cp) mesh, its CUDA twin never made.
        The mesh is a table of rank numbers: made outside a rehearsal's fake mode."""
        key = (tuple(id(g) for g in groups), device_type)
        if key not in self._meshes:
            with unset_fake_temporarily():
                if len(groups) == 1:
                    self._meshes[key] = DeviceMesh.from_group(groups[0], device_type)
                else:
                    self._meshes[key] = DeviceMesh.from_group(list(groups), device_type, mesh=torch.tensor(grid),
                                                              mesh_dim_names=names)
        return self._meshes[key]

    def _grid2d(self) -> list:
        """(tp, dp x cp) ranks of the 2-D mesh, tp first: the tp cut is the outer one (FSDP cuts the tp-local
        piece); row i is the dp x cp group of tp rank i (tp is the grid's innermost dim). Example, tp=2 on 8 ranks:
        ``[[0, 2, 4, 6], [1, 3, 5, 7]]``."""
        world, tp = self.topo.world_size, self.topo.tp
        return [list(range(i, world, tp)) for i in range(tp)]

    def _grid_ep(self) -> list:
        """(ep, edp) ranks of this rank's dp x cp group: row i the ranks of expert rank i. Example, dp x cp = 4,
        ep = 2, tp = 1: ``[[0, 2], [1, 3]]``."""
        g, ep = self.topo.ranks(Axis.DP_CP), self.topo.ep
        return [g[i::ep] for i in range(ep)]

    def _stored_experts(self, t: torch.Tensor) -> torch.Tensor:
        """An expert rank's experts (``[E/ep, ...]``, or FSDP2's shard of them over the expert-data ranks) as a
        DTensor of the stored ``[E, ...]``: ``Shard(0)`` over the expert group, then over the expert-data group.
        Example, E = 8, ep = 2, FSDP2 over 2 expert-data ranks: rank (ep 1, edp 0) holds experts 4-5."""
        ep_group = self.topo.group(Axis.EP)
        if not isinstance(t, DTensor):
            return DTensor.from_local(t, self._mesh((ep_group,), t.device.type), [Shard(0)], run_check=False)
        view = t.to_local()
        shape = (t.shape[0] * self.topo.ep, *t.shape[1:])
        mesh = self._mesh((ep_group, t.device_mesh.get_group()), view.device.type, self._grid_ep(), ("ep", "edp"))
        return DTensor.from_local(view, mesh, [Shard(0), Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def _stored_fsdp(self, t: DTensor, p) -> torch.Tensor:
        """An FSDP shard (a DTensor on the dp x cp mesh, ``Shard(f)`` of the tp-local piece) as a DTensor of the
        stored full tensor."""
        part = tp_partition(p)
        f = t.placements[0].dim
        view, d = stored_view(t.to_local(), part)
        if d is not None and part[1] > 1 and f >= part[0]:
            f += 1  # the stride split added a dim before the FSDP one
        shape = list(stored_view(torch.empty(t.shape, device="meta"), part)[0].shape)
        device = view.device.type
        if d is not None and self.topo.tp > 1:
            shape[d] *= self.topo.tp
            mesh = self._mesh((self.topo.group(Axis.TP), t.device_mesh.get_group()), device, self._grid2d())
            placements = [Shard(d), Shard(f)]
        else:
            mesh, placements = self._mesh((t.device_mesh.get_group(),), device), [Shard(f)]
        return DTensor.from_local(view, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())

    def stored(self, t: torch.Tensor, p) -> torch.Tensor:
        """``t`` (parameter ``p``'s local data or a state of its shape) as DCP stores it; shares ``t``'s memory."""
        if is_expert(p) and self.topo.ep > 1:
            return self._stored_experts(t)
        if isinstance(t, DTensor):
            return self._stored_fsdp(t, p)
        view, dim = stored_view(t, tp_partition(p))
        if dim is None or self.topo.tp == 1:
            return view
        return DTensor.from_local(view, self._mesh((self.topo.group(Axis.TP),), t.device.type), [Shard(dim)],
                                  run_check=False)

    def model_state(self) -> dict:
        return {f"model/{n}": self.stored(p.data, p) for n, p in self.model.named_parameters()}

    def _owned(self, opt) -> list:
        return [p for g in local_optimizer(opt).param_groups for p in g["params"]]

    def optimizer_state(self, opt) -> dict:
        """The AdamW states of the parameters this rank's optimizer steps (none before its first step)."""
        out = {}
        state = local_optimizer(opt).state
        for p in self._owned(opt):
            st = state.get(p)
            if not st:
                continue
            name = self.names[id(p)]
            for k in MOMENTS:
                out[f"optim/{name}/{k}"] = self.stored(st[k], p)
            out[f"optim/{name}/step"] = st["step"]
        return out

    def optimizer_targets(self, opt) -> tuple[dict, list]:
        """Fresh AdamW states to load into: (the DCP state dict, ``[(param, state)]`` to install afterwards)."""
        out, install = {}, []
        for p in self._owned(opt):
            name = self.names[id(p)]
            st = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p.data),
                  "exp_avg_sq": torch.zeros_like(p.data)}
            for k in MOMENTS:
                out[f"optim/{name}/{k}"] = self.stored(st[k], p)
            out[f"optim/{name}/step"] = st["step"]
            install.append((p, st))
        return out, install

    @staticmethod
    def install(opt, install: list) -> None:
        state = local_optimizer(opt).state
        for p, st in install:
            state[p] = st


SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def _no_dist() -> bool:
    """One process, or a rehearsal's fake process group (no rank answers DCP's collectives: each simulated rank
    writes and reads its own pieces alone)."""
    return not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) or fake_world()


def _without_values(state: dict) -> bool:
    """A rehearsal's state: fake tensors, nothing to write (``size_only.py``)."""
    t = next((v for v in state.values() if isinstance(v, torch.Tensor)), None)
    return t is not None and not has_values(t.to_local() if isinstance(t, DTensor) else t)


def _writer(path: str, state: dict):
    return SizeOnlyWriter(path) if _without_values(state) else None


def write(path: str, state: dict, collective: bool = True) -> None:
    """DCP save of ``state`` into directory ``path`` (every rank calls it with its own pieces; ``collective``
    False: this process alone, e.g. an import). A failure on any rank raises its root cause on every rank."""
    with _single_process_quiet(), root_cause_of_failures(), unset_fake_temporarily():
        dcp.save(state, checkpoint_id=path, storage_writer=_writer(path, state),
                 no_dist=not collective or _no_dist())


def write_async(path: str, state: dict, group, stager) -> Future:
    """``write`` in the background (``checkpoint.async_save``): DCP's ``async_save`` copies ``state`` to host memory
    through ``stager`` (the caller's, kept across saves: ``async_save.py``) and returns once staged; the write goes
    on in a thread. ``group``: the process group of the write's own collectives (None: one process). Wait for it
    with ``wait_written``."""
    alone = group is None and _no_dist() or fake_world()
    if alone:  # the background thread's own single-process save warns too, outside any catch_warnings
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
    writer = _writer(path, state)  # a rehearsal's state stages through its size-only writer (fake host copies)
    with _single_process_quiet(), unset_fake_temporarily():
        return dcp.async_save(state, checkpoint_id=path, storage_writer=writer, process_group=None if alone else group,
                              no_dist=alone, async_stager=stager if writer is None else None)


def wait_written(future: Future) -> None:
    """The end of a ``write_async``; a failure on any rank raises its root cause on every rank (as ``write``)."""
    with root_cause_of_failures():
        future.result()


def read(path: str, state: dict, collective: bool = True, trust_pickle: bool = False) -> None:
    """DCP load into the tensors of ``state``, in place (views included: a parameter is loaded where it lives).
    The metadata is read as data (``checkpoint_data.DataOnlyReader``); a failure on any rank raises its root cause
    on every rank."""
    reader = (SizeOnlyReader if _without_values(state) else DataOnlyReader)(path, trust_pickle)
    reader.read_metadata()  # a refusal or an unreadable file raised as is, before DCP
    with _single_process_quiet(), root_cause_of_failures(), torch_types_only(), unset_fake_temporarily():
        dcp.load(state, storage_reader=reader, no_dist=not collective or _no_dist())


def root_cause(e: BaseException) -> BaseException:
    """The exception behind DCP's ``CheckpointException`` (a ``BaseException`` that wraps every failed rank's
    error with its traceback: ~170 lines): the lowest failed rank's own error, e.g. ``OSError(28, 'No space left
    on device')``."""
    while isinstance(e, CheckpointException) and e.failures:
        e = e.failures[min(e.failures)][0]
    return e


@contextlib.contextmanager
def root_cause_of_failures():
    """Raise DCP's failures as ``root_cause``, with ``failed_rank`` set to the rank it happened on."""
    try:
        yield
    except CheckpointException as e:
        cause, rank = e, None
        while isinstance(cause, CheckpointException) and cause.failures:
            rank = min(cause.failures)
            cause = cause.failures[rank][0]
        cause.failed_rank = rank
        raise cause from None


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every single-process save/load that it assumes a single process: that is what we asked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def full_model_state(path: str, cfg: Config) -> dict:
    """The full (unsharded) model weights of a DCP checkpoint, read by this process alone (exports, tools)."""
    out, target = {}, {}
    for name, (shape, partition) in parameter_shapes(cfg).items():
        out[name] = torch.empty(shape)
        target[f"model/{name}"] = stored_view(out[name], partition)[0]
    read(path, target, collective=False, trust_pickle=cfg.checkpoint.trust_pickle)
    return out


def write_full_model(path: str, cfg: Config, full: dict) -> None:
    """A DCP checkpoint of full model weights ``{name: tensor}`` (an import), written by this process alone."""
    shapes = parameter_shapes(cfg)
    write(path, {f"model/{n}": stored_view(t.contiguous(), shapes[n][1])[0] for n, t in full.items()},
          collective=False)
