"""Everything a run needs before step 1, in order, each step a call you can see::

    config -> layout -> topology -> data -> model (pure) -> device -> calibration (Memo) -> memory plan
           -> FSDP2 (sharding) -> optimizer -> checkpoint

``pretrain_gpt.py`` resolves the layout and builds the topology first (``runtime.init_distributed``: the layout's
errors come before any process group exists) and hands both to ``setup_training``; tests and tools pass a
topology of their own. Nothing here changes the config.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..attention.fpdt.calibrate import calibrate_fpdt
from ..config import Config, ConfigError, Layout, resolve_layout
from ..data import build_dataset, make_batch, microbatch_sample_ids
from ..memory.arena import PlannedArena
from ..memory.checkpoint_offload import check_host_budget
from ..memory.memo import calibrate_memo
from ..parallel.fsdp import apply_fsdp
from ..parallel.parallelize import ModelContext, ModelSpec, build_model
from ..parallel.token_layout import shard_batch
from ..parallel.topology import Topology
from ..planning.runtime import check_plan_setting, plan_memory
from .checkpoint import load_checkpoint
from .checkpoint_dir import check_save_dir
from .optimizer import build_optimizer

log = logging.getLogger("megatron_lc")


@dataclass
class TrainingSetup:
    """What ``setup_training`` built; the loop (``loop.Trainer``) runs it."""

    cfg: Config
    layout: Layout
    topo: Topology
    device: torch.device
    dataset: object
    model: torch.nn.Module
    ctx: ModelContext
    arena: Optional[PlannedArena]  # the installed memory plan's arena (None: memory.plan off)
    optimizer: torch.optim.Optimizer
    resumed: Optional[dict]  # the loaded checkpoint's meta (None: a fresh start)

    def autocast(self):
        return training_autocast(self.cfg, self.device)

    def microbatches(self, consumed: int) -> list[dict]:
        return microbatches(self.cfg, self.layout, self.topo, self.dataset, consumed, self.device)


def training_autocast(cfg: Config, device: torch.device):
    """bf16 autocast on CUDA with ``train.bf16`` (fp32 master weights), else nothing."""
    if cfg.train.bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def microbatches(cfg: Config, layout: Layout, topo: Topology, dataset, consumed: int, device: torch.device) -> list:
    """This rank's micro-batches of the step that starts after ``consumed`` global samples, sharded for its cp rank.

    The step's samples are ``[consumed, consumed + gbs)`` whatever the step number, so a run resumed with another
    global batch size (or dp) still reads every sample exactly once."""
    out = []
    for m in range(layout.num_micro_batches):
        ids = [consumed + i for i in microbatch_sample_ids(m, layout.global_batch_size, layout.micro_batch_size,
                                                           layout.dp, topo.dp_rank)]
        batch = shard_batch(make_batch(dataset, ids, cfg.data), layout, topo)
        out.append({k: v.to(device) for k, v in batch.items()})
    return out


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


def build_and_calibrate(cfg: Config, layout: Layout, topo: Topology, device: torch.device,
                        adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None):
    """Steps 3-5 of the setup: the pure model build, the move to ``device``, Memo's calibration (every rank must
    call this when Memo offload is on: the profile runs the layer's collectives). Returns (model, context)."""
    model, ctx = build_model(cfg, layout, topo, adjust_spec)  # 3. pure: host memory, no communication
    model.to(device)  # 4.
    if ctx.fpdt is not None:  # 5. FPDT offload: one layer's parked chunks measured, the host pool's share reserved
        calibrate_fpdt(model, ctx.fpdt, layout, cfg.memory.fpdt_offload, topo, device,
                       lambda: training_autocast(cfg, device))
    if ctx.memo is not None:  # 5. bind Memo's runtime; with offload: profile layer 0, alpha, rounding buffers
        calibrate_memo(model, ctx.memo, cfg.memory, layout, topo, device, lambda: training_autocast(cfg, device))
    if ctx.checkpoints is not None:  # 5. the layer inputs' host copies within the host budget
        ctx.checkpoints.bind(device)
        check_host_budget(ctx.checkpoints, cfg.memory.host_memory_gb, topo.rank)
    return model, ctx


def setup_training(cfg: Config, topo: Topology, device: Optional[torch.device] = None,
                   layout: Optional[Layout] = None,
                   adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None) -> TrainingSetup:
    """Build a run (see module doc). ``layout``: already resolved for ``topo``'s world (else resolved here, once);
    ``adjust_spec``: see ``parallelize.build_model``."""
    device = device or torch.device("cpu")
    layout = layout or resolve_layout(cfg, topo.world_size)  # 1. every layout rule and refused feature pair
    check_topology(layout, topo)
    check_plan_setting(cfg.memory.plan)  # a plan path that does not exist or does not parse: before the work
    check_save_dir(cfg)  # never mix two runs in one checkpoint.save
    check_positions(cfg)
    dataset = build_dataset(cfg)  # 2. data files checked before the (possibly long) model build
    torch.manual_seed(cfg.train.seed)
    model, ctx = build_and_calibrate(cfg, layout, topo, device, adjust_spec)  # 3-5.
    first = microbatches(cfg, layout, topo, dataset, 0, device)[0] if cfg.memory.plan != "off" else None
    arena = plan_memory(cfg.memory.plan, model, ctx.arena, first, device, topo.rank,  # 6. memory plan
                        cfg.memory.plan_time_limit, cfg.checkpoint.save, lambda: training_autocast(cfg, device))
    if cfg.parallel.use_torch_fsdp2:  # 7. weights, gradients and (so) AdamW states sharded over dp x cp
        apply_fsdp(model, topo, device, bf16=cfg.train.bf16 and device.type == "cuda",
                   cpu_offload=cfg.parallel.fsdp_cpu_offload)
    optimizer = build_optimizer(model, cfg, topo)  # 8.
    resumed = load_checkpoint(cfg, topo, model, optimizer)  # 9. weights, optimizer, RNG, data position
    if resumed is not None:
        log.info("resumed from %s at iteration %d", resumed["path"], resumed["iteration"])
    return TrainingSetup(cfg, layout, topo, device, dataset, model, ctx, arena, optimizer, resumed)
