"""Sharded model states: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) over the dp x cp ranks, under our
own tensor parallelism (``parallel.use_torch_fsdp2``).

cp ranks hold identical parameters, like dp ranks, so the shard mesh is the dp x cp group: every parameter's
tp-local piece is cut into dp x cp shards, each rank keeps one (fp32 master weight, its gradient, its AdamW
states). Each transformer layer is one FSDP unit (all-gathered just before its forward and again before its
backward, freed after each: peak = one layer's full weights on top of the shards), so are the embedding and the
head when they are untied; the final norm (and a tied embedding / head) is the root unit.

Example, 8 ranks, tp=2, cp=4 (dp x cp groups ``[0,2,4,6]`` and ``[1,3,5,7]``, see ``topology.py``): a layer's
QKV weight ``[3072, 2048]`` is ``[1536, 2048]`` per tp rank (rows), and each of ranks 0, 2, 4, 6 keeps a quarter of
tp rank 0's piece, ``[1536, 512]`` -- FSDP cuts a dim other than the tp partition (``shard_dim``), so a checkpoint
can name every shard as a box of the full tensor (``training/checkpointing/sharded_state.py``).

Expert parallelism: an MoE layer's experts (``expert_parallel.py``) differ between the ranks of an expert group, so
they are their own units, sharded over the expert-data ranks (``Axis.EDP``: the ranks holding the same experts), as
torchtitan shards its experts. Example, dp x cp = 4, ep = 2: ranks 0 and 2 hold experts 0-3, and each keeps half of
them; ranks 1 and 3 experts 4-7.

Gradients: our loss is the global mean divided out before backward, so the dp x cp reduction must be a SUM (FSDP2
averages by default: ``set_gradient_divide_factor(1)``); with ``train.bf16`` the weights are all-gathered in bf16
and reduced in fp32 (``MixedPrecisionPolicy``), master weights and AdamW stay fp32. ``parallel.fsdp_cpu_offload``:
shards, gradients and AdamW live on the host (``CPUOffloadPolicy``), the one-GPU case.

The layer executors (recompute, Memo, MsT, FPDT) run inside ``TransformerLayer.forward``, so FSDP's hooks gather
the weights before any of them touches a parameter, also when they recompute in backward.

Prefetch (``prefetch_in_order``): each unit, as it starts, issues the all-gather of the next unit in forward order
(embedding, layers, head) and, in backward, of the previous one -- explicitly, not left to the host running ahead of
the GPU: the memory techniques make the host wait on events and copies, so without it a layer's gather would be
issued only when its forward begins, exposed behind the previous layer's compute.
"""
from __future__ import annotations

import contextlib
import os
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..config import ConfigError
from .expert_parallel import is_expert
from .tensor_parallel import tp_partition
from .topology import Axis, Topology

def shard_dim(p: torch.Tensor) -> int:
    """The dim FSDP cuts: one other than the tp partition dim when there is one (0 for 1-D tensors)."""
    part = tp_partition(p)
    if p.ndim < 2 or part is None:
        return 0
    return 1 if part[0] == 0 else 0


def fsdp_mesh(topo: Topology, device: torch.device, axis: Axis = Axis.DP_CP):
    """The 1-D device mesh of this rank's dp x cp group (the group the gradients were all-reduced over; the
    experts' under expert parallelism: ``Axis.EDP``); with dp x cp = 1 (one GPU with ``fsdp_cpu_offload``, or tp
    alone) a group of this rank alone."""
    group = topo.group(axis)
    if group is None:
        if not dist.is_initialized():  # one process without a launcher (a tool, a test): a group of itself
            if topo.world_size > 1:
                raise ConfigError(f"parallel.use_torch_fsdp2 on {topo.world_size} ranks needs torch.distributed "
                                  f"initialised (run under torchrun / pretrain_gpt.py)")
            start_one_process_group("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo")
        group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # every rank: all
    with unset_fake_temporarily():  # the mesh's rank map is a real tensor of rank numbers, also in a rehearsal
        return DeviceMesh.from_group(group, device.type)


def start_one_process_group(backend: str, timeout=None) -> None:
    """A process group of this process alone (FSDP2 needs one): through the launcher's rendezvous when there is
    one (``MASTER_ADDR`` set), else on a free local port."""
    if "MASTER_ADDR" in os.environ:
        init = "env://"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    kw = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method=init, rank=0, world_size=1, **kw)


def check_shardable(model: nn.Module) -> None:
    """A 1-D parameter cut over tp with a stride (SwiGLU's fc1 bias) cannot also be cut over dp x cp so that a
    checkpoint names each shard as one box of the full tensor."""
    for n, p in model.named_parameters():
        part = tp_partition(p)
        if p.ndim == 1 and part is not None and part[1] > 1:
            raise ConfigError(f"parallel.use_torch_fsdp2 with model.add_bias_linear and model.swiglu: parameter {n} "
                              f"is 1-D and partitioned with stride {part[1]}; its FSDP shards would not be boxes of "
                              f"the checkpoint's tensor (set add_bias_linear false)")


def apply_fsdp(model: nn.Module, topo: Topology, device: torch.device, *, param_dtype: Optional[torch.dtype],
               cpu_offload: bool, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` in place (layers, then the root); parameter attributes (tp partition, SP) are carried over
    to the sharded parameters, each shard moved to ``device`` (so a model built on the host lands there a shard at
    a time, never whole; ``training/setup.py`` shards the model on the meta device and ``model/init.materialize``
    makes the shards). ``param_dtype``: the dtype the weights are all-gathered in (the run's autocast dtype;
    None: as stored). Call before the calibrations (they gather the layer they probe: ``gathered``) and the
    optimizer."""
    check_shardable(model)
    attrs = {n: dict(vars(p)) for n, p in model.named_parameters()}  # tp partition, SP, init: every attribute
    dims = {id(p): shard_dim(p) for p in model.parameters()}
    # the residual stream stays fp32 between units (cast_forward_inputs False), as without FSDP under autocast
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    kw = dict(mesh=fsdp_mesh(topo, device), mp_policy=mp,
              offload_policy=CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy(),
              shard_placement_fn=lambda p: Shard(dims[id(p)]))
    units = list(model.layers)
    if model.cfg.untie_embeddings_and_output_weights:  # tied: one weight, so one unit (the root)
        units += [model.embedding, model.head]
    experts = []
    if topo.ep > 1:  # an MoE layer's experts differ over the expert group: sharded over the ranks holding the same
        experts = [m for m in model.modules() if any(is_expert(p) for p in m.parameters(recurse=False))]
        for unit in experts:  # (before their layers: a unit's parameters are its own, not its parent's)
            fully_shard(unit, reshard_after_forward=reshard_after_forward, **{**kw, "mesh": fsdp_mesh(
                topo, device, Axis.EDP)})
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kw)
    prefetch_in_order(([model.embedding] if model.cfg.untie_embeddings_and_output_weights else []) +
                      list(model.layers) + ([model.head] if model.cfg.untie_embeddings_and_output_weights else []))
    for m in [*experts, *units, model]:
        m.set_gradient_divide_factor(1.0)  # a SUM over dp x cp: the loss already is the global mean
        m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
    for n, p in model.named_parameters():
        for a, v in attrs[n].items():
            setattr(p, a, v)
    # the model returns the loss transposed (a view); the loop only reads it out of place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPGPTModel\) returned a view tensor")
    return model


def prefetch_in_order(units: list) -> None:
    """Unit i gathers unit i+1 as its forward starts and unit i-1 as its backward starts (module doc); the layers
    of an untied model: embedding -> layer 0 -> ... -> layer L-1 -> head, and back."""
    for a, b in zip(units, units[1:]):
        a.set_modules_to_forward_prefetch([b])
        b.set_modules_to_backward_prefetch([a])


@contextlib.contextmanager
def gathered(module: nn.Module):
    """``module``'s full weights inside (an FSDP2 unit: all-gathered, resharded on exit; else nothing to do): for a
    calibration that probes one layer of the sharded model outside its forward hooks."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def is_sharded(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor)


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The local shard of an FSDP parameter, gradient or optimizer state (``t`` itself when not sharded)."""
    return t.to_local() if t is not None and is_sharded(t) else t
