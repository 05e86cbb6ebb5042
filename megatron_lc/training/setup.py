"""Everything a run needs before step 1, in order, each step a call you can see::

    config -> layout -> execution (device, dtypes) -> topology -> data -> model (pure, on the host; with FSDP2
           on the meta device) -> FSDP2 (sharding, then each rank's shards made on the device and drawn) -> device
           -> technique runtimes (bind, calibrate, allocate; the memory plan last) -> optimizer -> checkpoint

``pretrain_gpt.py`` resolves the layout and builds the topology first (``runtime.init_distributed``: the layout's
errors come before any process group exists) and hands both to ``setup_training``; tests and tools pass a
topology of their own. Nothing here changes the config.
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..compose import Calibration, ModelContext, ModelSpec, build_model
from ..config import Config, ConfigError, Execution, Layout, resolve_execution, resolve_layout
from ..data import DataSplits, build_dataset, split_sizes
from ..device import HostMemoryError, HostPool, host_share, pool_budget_error
from ..memory.arena import PlannedArena
from ..model.init import materialize
from ..parallel.collectives import all_gather_objects
from ..parallel.fsdp import apply_fsdp
from ..parallel.topology import Topology
from ..planning.memory_plan import check_plan_setting
from .batches import microbatches
from .checkpointing.async_save import STAGING, staging_bytes
from .checkpointing.directory import check_save_dir, find_latest, read_meta
from .checkpointing.load import load_checkpoint
from .optimizer import build_optimizer

log = logging.getLogger("megatron_lc")

HOST_HINT = "use more ranks (context parallel), a shorter data.seq_length or raise memory.host_memory_gb"


@dataclass
class TrainingSetup:
    """What ``setup_training`` built; the loop (``loop.Trainer``) runs it."""

    cfg: Config
    layout: Layout
    topo: Topology
    execution: Execution
    dataset: object  # the train split
    model: torch.nn.Module
    ctx: ModelContext
    optimizer: torch.optim.Optimizer
    resumed: Optional[dict]  # the loaded checkpoint's meta (None: a fresh start)
    splits: Optional[DataSplits] = None  # train, valid and test samples (valid / test: None when not read)

    @property
    def arena(self) -> Optional[PlannedArena]:
        """The installed memory plan's arena (None: memory.plan off)."""
        return self.ctx.plan.planned if self.ctx.plan is not None else None


def resume_position(cfg: Config) -> tuple[int, int]:
    """(iteration, consumed samples) of the newest checkpoint under ``checkpoint.load``; (0, 0) without one or with
    ``finetune``. The training split is built for the samples the run reads from there (``data.split_sizes``)."""
    load = cfg.checkpoint.load
    path = find_latest(load) if load and not cfg.checkpoint.finetune and os.path.isdir(load) else None
    if path is None:
        return 0, 0
    try:
        meta = read_meta(path)
    except ConfigError:  # load_checkpoint says what is wrong with it
        return 0, 0
    return int(meta.get("iteration", 0)), int(meta.get("consumed_samples", 0))


def check_positions(cfg: Config) -> None:
    """RoPE past ``model.max_position_embeddings``: trains, said once (learned positions are refused by the layout)."""
    m, s = cfg.model, cfg.data.seq_length
    if m.position_embedding_type == "rope" and s > m.max_position_embeddings:
        log.warning("data.seq_length (%d) exceeds model.max_position_embeddings (%d): RoPE goes past the length the "
                    "model was declared for; set max_position_embeddings to at least %d (an export records %d)",
                    s, m.max_position_embeddings, s, s)


def check_topology(layout: Layout, topo: Topology) -> None:
    if (topo.world_size, topo.tp, topo.cp, topo.ulysses) != (layout.world_size, layout.tp, layout.cp, layout.ulysses):
        raise ConfigError(f"the topology ({topo.describe()}) does not match the config's layout (world "
                          f"{layout.world_size}, tp {layout.tp}, cp {layout.cp}, ulysses {layout.ulysses})")


def check_host_budget(pool: HostPool, host_memory_gb, rank: int) -> None:
    """The pool's exact size (and what is held beside it) against this rank's share of its node's host memory, the
    same decision on every rank: each reads its share now, before any rank pins (``pool.allocate`` comes after this
    collective on every rank), the node's ranks take the smallest reading (``MemAvailable`` only falls as neighbours
    allocate), and a pool that does not fit on any rank is that rank's one ``HostMemoryError`` line on all of them --
    never one rank refusing alone while the others wait in their first collective. Example: 2 ranks on a node read
    40 and 30 GiB (the first read before the second's neighbour pinned): both take 30."""
    share, source = host_share(host_memory_gb)
    host = socket.gethostname()
    agreed = min(s for h, s in all_gather_objects((host, share)) if h == host)
    errors = [e for e in all_gather_objects(pool_budget_error(pool, agreed, source, rank, HOST_HINT)) if e]
    if errors:
        raise HostMemoryError(errors[0])


def run_technique_runtimes(model, ctx: ModelContext, env: Calibration) -> None:
    """The technique runtimes (``compose/context.py``), each step over all of them in their order: bind to the
    device; calibrate on the built model (each reserves its host-pool share); the host pool's exact size against
    this rank's host budget, once, and its allocation (pinned on CUDA), before anything takes from it; allocate
    the device buffers (the memory plan last, tracing a step with every other buffer in place). Every rank calls
    this: the calibrations run the layer's collectives."""
    for rt in ctx.runtimes:
        rt.bind(env.execution.device)
    for rt in ctx.runtimes:
        rt.calibrate(model, env)
    if ctx.host_pool.budget_bytes:
        check_host_budget(ctx.host_pool, env.cfg.memory.host_memory_gb, env.topo.rank)
    if ctx.host_pool.size:
        ctx.host_pool.allocate()  # page-locked here: a failure is one line before training, not a rank stuck in
        # its first forward while the others wait for it in p2p
    for rt in ctx.runtimes:
        rt.allocate()


def build_and_calibrate(cfg: Config, layout: Layout, topo: Topology, execution: Execution,
                        adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None,
                        batch: Optional[Callable[[], dict]] = None,
                        stage: Callable[[str], None] = lambda name: None):
    """The pure model build, FSDP2's sharding, the move to the device, the technique runtimes
    (``run_technique_runtimes``). ``batch``: a micro-batch of the training shape, for a runtime that traces a real
    step (the memory plan); ``stage``: told each stage's name as it starts (``setup_training``). Returns (model,
    context)."""
    stage("build")
    fsdp2 = cfg.parallel.use_torch_fsdp2
    # FSDP2: built on the meta device (no storage), so no rank ever holds the whole model, on the host or the
    # device; else on the host (or the device of a rehearsal)
    where = torch.device("meta") if fsdp2 else execution.device if execution.build_on_device else None
    with torch.device(where) if where is not None else contextlib.nullcontext():
        model, ctx = build_model(cfg, layout, topo, adjust_spec, execution, init=not fsdp2)  # pure: no communication
    stage("device")
    if fsdp2:  # weights, gradients and (so) AdamW states sharded over dp x cp, then each rank's shards made and
        # initialised on the device (the host with CPU offload); the calibrations gather the layer they probe, the
        # step each layer it runs
        apply_fsdp(model, topo, execution.device, param_dtype=execution.autocast_dtype,
                   cpu_offload=cfg.parallel.fsdp_cpu_offload)
        materialize(model, cfg.train.seed, topo, torch.device("cpu") if cfg.parallel.fsdp_cpu_offload
                    else execution.device, buffer_device=execution.device)
    elif any(p.device != execution.device for p in model.parameters()):
        # (not under FSDP2: it placed the shards, on the host with fsdp_cpu_offload -- a move here would put the
        # offloaded shards on the device and FSDP2 refuses them at the first forward)
        model.to(execution.device)
    env = Calibration(cfg, layout, topo, execution, batch or _no_batch)
    if cfg.checkpoint.async_save and cfg.checkpoint.save:  # the async save's staging area, budgeted with the pool
        ctx.host_pool.hold(STAGING, staging_bytes(model, cfg, topo))  # (before Memo's alpha LP reads the budget)
    stage("runtimes")
    run_technique_runtimes(model, ctx, env)
    return model, ctx


def _no_batch() -> dict:
    raise ConfigError("memory.plan traces a micro-batch of the training data, and this build was given none")


def setup_training(cfg: Config, topo: Topology, device: Optional[torch.device] = None,
                   layout: Optional[Layout] = None,
                   adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None,
                   execution: Optional[Execution] = None,
                   stage: Callable[[str], None] = lambda name: None) -> TrainingSetup:
    """Build a run (see module doc). ``layout``: already resolved for ``topo``'s world (else resolved here, once);
    ``adjust_spec``: see ``compose.build_model``; ``execution``: given instead of resolved from ``device`` (a
    rehearsal: a GPU run's dtypes on a stand-in device); ``stage``: told the name of each stage as it starts --
    data, build (the model on the host, on the meta device with FSDP2), device (FSDP2's shards, the move), runtimes, optimizer, checkpoint (a
    rehearsal marks its trace with them)."""
    layout = layout or resolve_layout(cfg, topo.world_size)  # every layout rule and refused feature pair
    check_topology(layout, topo)
    # the one answer to "bf16? which device?"
    execution = execution or resolve_execution(cfg, device or torch.device("cpu"))
    check_plan_setting(cfg.memory.plan)  # a plan path that does not exist or does not parse: before the work
    check_save_dir(cfg)  # never mix two runs in one checkpoint.save
    check_positions(cfg)
    stage("data")
    # data files checked before the (possibly long) model build; sized for the samples the run will read
    splits = build_dataset(cfg, split_sizes(cfg, layout.global_batch_size, *resume_position(cfg)))
    dataset = splits.train
    torch.manual_seed(cfg.train.seed)

    def first() -> dict:  # what the memory plan traces: the first micro-batch of step 1
        return microbatches(cfg, layout, topo, dataset, 0, execution.device)[0]

    model, ctx = build_and_calibrate(cfg, layout, topo, execution, adjust_spec, first, stage)
    stage("optimizer")
    optimizer = build_optimizer(model, cfg, topo)
    stage("checkpoint")
    resumed = load_checkpoint(cfg, topo, model, optimizer)  # weights, optimizer, RNG, data position
    if resumed is not None:
        log.info("resumed from %s at iteration %d", resumed["path"], resumed["iteration"])
    return TrainingSetup(cfg, layout, topo, execution, dataset, model, ctx, optimizer, resumed, splits)
