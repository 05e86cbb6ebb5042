"""The run-time state of a built model's memory techniques, and the one protocol setup runs them by.

``ModelContext`` is returned beside the model by ``build_model`` (never attached to it): the arena framework
buffers come from, the host pool, and one *technique runtime* per memory technique the config turns on. A
technique runtime has four parts; ``training/setup.py`` (``run_technique_runtimes``) calls each step for every
runtime of ``ModelContext.runtimes``, in that list's order, after the model is built and on its device::

    TAG                       its share of the host pool (``HostPool.reserved[TAG]``)
    bind(device)              the device it serves: its copy streams, the host pool's device
    calibrate(model, env)     measure what depends on this machine and the built model (``env``: a
                              ``Calibration``) and reserve its host-pool share
                              -- then the pool's exact size is checked against the host budget, once --
    allocate()                its device buffers, of the calibrated size

The runtimes, in order (FPDT measures first: Memo's alpha LP gets the host budget less what FPDT reserved; the
memory plan allocates last: it traces a step with every other buffer in place):

    runtime                          home                            calibrate                 allocate
    FPDTRuntime (cp_comm_type fpdt)  attention/fpdt/runtime.py       one block's parked        --
                                                                     chunks (fpdt_offload)
    MemoRuntime (full / memo)        memory/memo/runtime.py          layer 0 profiled, alpha   rounding buffers
    CheckpointOffload (checkpoints)  memory/checkpoint_offload.py    ceil(L / k) inputs        --
    MemoryPlan (memory.plan)         planning/memory_plan.py         a plan file loaded        a micro-batch traced
                                                                                               and planned; the arena
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch

from ..attention.fpdt.runtime import FPDTRuntime
from ..config import Config, Execution, Layout, resolve_techniques
from ..device import HostPool
from ..memory.arena import ArenaHandle
from ..memory.checkpoint_offload import CheckpointOffload
from ..memory.chunked_layer import BlockAttentionPart, CoreAttentionPart
from ..memory.memo import MemoRuntime
from ..model.moe_loss import RoutingRecord
from ..parallel.topology import Topology
from ..planning.memory_plan import MemoryPlan


class TechniqueRuntime(Protocol):
    """What setup calls on each memory technique's runtime (see module doc)."""

    TAG: str

    def bind(self, device: torch.device) -> None: ...

    def calibrate(self, model, env: "Calibration") -> None: ...

    def allocate(self) -> None: ...


@dataclass(frozen=True)
class Calibration:
    """What a runtime's ``calibrate`` reads: the run and, for a runtime that traces a real step, a micro-batch of
    the training shape (made on first call; the other runtimes probe a layer with ``model/probe.py``'s input)."""

    cfg: Config
    layout: Layout
    topo: Topology
    execution: Execution
    batch: Callable[[], dict]


@dataclass
class ModelContext:
    """Run-time state of a built model's memory techniques, returned beside the model by ``build_model``."""

    arena: ArenaHandle = field(default_factory=ArenaHandle)  # where framework buffers come from (memory plan)
    host_pool: HostPool = field(default_factory=HostPool)  # the offload techniques' host memory: one allocation
    fpdt: Optional[FPDTRuntime] = None  # FPDT blocks: device / host accounts, per-device buffers and streams
    memo: Optional[MemoRuntime] = None  # recompute_granularity full / Memo offload: buffers, host copies, counters
    checkpoints: Optional[CheckpointOffload] = None  # activation_offload checkpoints: layer inputs on the host
    plan: Optional[MemoryPlan] = None  # memory.plan auto / a plan file: the planned arena
    # the MoE routers' counts of a forward and the load-balancing / z-loss gradients they give (model/moe_loss.py);
    # the default records nothing (a model without experts)
    routing: RoutingRecord = field(default_factory=RoutingRecord)

    @property
    def runtimes(self) -> list:
        """The technique runtimes in setup order (see module doc)."""
        return [rt for rt in (self.fpdt, self.memo, self.checkpoints, self.plan) if rt is not None]


# the attention of the host checkpoints' chunked layer, by its re-run (``config.Techniques.layer_rerun``): the core
# attention's (out, lse) pair, or FPDT's block with norm 1 inside its chunk projections
CHUNKED_ATTENTION = {"at_once": CoreAttentionPart, "layer_mini_sequences": CoreAttentionPart,
                     "block_mini_sequences": BlockAttentionPart}


def model_context(cfg: Config, layout: Layout) -> ModelContext:
    """The context the spec's modules will share: one runtime per technique ``cfg`` turns on, by the same key the
    spec builds its classes by (``config.resolve_techniques``)."""
    m, t = cfg.memory, resolve_techniques(cfg, layout)
    ctx = ModelContext()
    if t.attention_block == "fpdt":
        ctx.fpdt = FPDTRuntime(ctx.arena, ctx.host_pool)
    if t.executor in ("token_wise_recompute", "memo_offload"):
        ctx.memo = MemoRuntime(cfg.model.num_layers, offload=t.executor == "memo_offload", pool=ctx.host_pool,
                               chunk_tokens=m.layer_chunk_size)
    if t.executor == "host_checkpoints":
        ctx.checkpoints = CheckpointOffload(cfg.model.num_layers, ctx.host_pool, m.layer_chunk_size,
                                            layout.sp_degree, every=m.checkpoint_every,
                                            attention_part=CHUNKED_ATTENTION[t.layer_rerun])
    if t.memory_plan != "none":
        ctx.plan = MemoryPlan(m.plan, ctx.arena)
    mc = cfg.model
    if mc.num_moe_experts is not None:
        ctx.routing = RoutingRecord(mc.num_moe_experts, mc.moe_aux_loss_coeff, mc.moe_z_loss_coeff,
                                    sum(mc.moe_layers()), layout.num_micro_batches, layout.sequence_parallel)
    return ctx
