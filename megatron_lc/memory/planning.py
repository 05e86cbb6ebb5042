"""``memory.plan: off | auto | <plan.json>`` at run time.

- ``off``: framework buffers are plain allocations (the default ``Arena`` of each module).
- ``auto``: before step 1, one forward + backward of the first micro-batch is traced (``capture_iteration``; the
  RNG state is restored and the gradients cleared, so training is unchanged), planned (``plan_trace``, time limit
  ``memory.plan_time_limit``, no solver time once within 0.1% of the lower bound), logged (planning seconds,
  peak, lower bound, simulated caching-allocator reserved),
  and the framework buffers are served from a ``PlannedArena`` built from the plan's ``arena`` section.
- ``<plan.json>``: a plan written by ``tools/plan_memory.py`` or an earlier ``auto`` run; its ``arena`` section
  is installed the same way. (On GPU, ``memory.arena_cuda`` can replay the whole plan through a pluggable
  allocator; that must happen before any CUDA allocation and was never executed here.)

With ``checkpoint.save`` set, ``auto`` writes ``memory_trace_rank{r}.jsonl`` and ``memory_plan_rank{r}.json`` there.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from ..config import ConfigError
from .arena import ArenaLayout, PlannedArena, Slot, install_arena
from .planner import Plan, plan_trace
from .planner_solvers import PlanError

log = logging.getLogger("megatron_lc")
AUTO_GAP = 1e-3  # auto: a plan within 0.1% of the lower bound is not worth solver time before step 1


def check_plan_setting(value: str) -> Optional[Plan]:
    """Validate ``memory.plan`` (ConfigError naming the value); returns the loaded plan for a path."""
    if value in ("off", "auto"):
        return None
    if not os.path.isfile(value):
        raise ConfigError(f"memory.plan ({value!r}) must be 'off', 'auto' or an existing plan JSON file")
    try:
        return Plan.load(value)
    except PlanError as e:
        raise ConfigError(f"memory.plan ({value!r}): {e}") from None


def layout_from_plan(plan: Plan) -> ArenaLayout:
    """The ``ArenaLayout`` of a plan's ``arena`` section (empty arena when the plan has none)."""
    a = plan.arena or {"size_bytes": 0, "slots": [], "persistent": []}
    layout = ArenaLayout(int(a["size_bytes"]),
                         {(tag, int(k)): Slot(int(o), int(n)) for tag, k, o, n in a.get("slots", [])},
                         {tag: Slot(int(o), int(n)) for tag, o, n in a.get("persistent", [])})
    try:
        layout.check()
    except ValueError as e:
        raise PlanError(f"plan arena section: {e}") from None
    return layout


def _profile(trainer) -> tuple:
    from .trace_capture import capture_iteration

    batch = trainer.microbatches(trainer.state.iteration)[0]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if trainer.device.type == "cuda" else None
    t0 = time.perf_counter()
    with trainer.autocast():
        trace = capture_iteration(trainer.model, batch, meta={"rank": trainer.topo.rank})
    seconds = time.perf_counter() - t0
    trainer.model.zero_grad(set_to_none=True)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return trace, seconds


def prepare_memory_plan(trainer) -> Optional[PlannedArena]:
    """Apply ``memory.plan`` to ``trainer.model`` before step 1; returns the installed arena (None for off)."""
    from .cachesim import simulate

    m = trainer.cfg.memory
    if m.plan == "off":
        return None
    rank = trainer.topo.rank
    if m.plan == "auto":
        trace, prof_s = _profile(trainer)
        plan = plan_trace(trace, time_limit=m.plan_time_limit, gap=AUTO_GAP)
        sim = simulate(trace)
        log.info("memory plan (auto): profiled %d requests in %.2fs, planned in %.2fs: peak %.2f MiB, lower bound "
                 "%.2f MiB (x%.4f), %s, %s; caching allocator would reserve %.2f MiB (x%.3f of the plan)",
                 len(plan.offsets), prof_s, plan.solve_seconds, plan.peak_bytes / 2**20,
                 plan.lower_bound_bytes / 2**20, plan.peak_bytes / max(plan.lower_bound_bytes, 1), plan.status,
                 plan.solver, sim.peak_reserved_bytes / 2**20, sim.peak_reserved_bytes / max(plan.peak_bytes, 1))
        save = trainer.cfg.checkpoint.save
        if save:
            os.makedirs(save, exist_ok=True)
            trace.dump(os.path.join(save, f"memory_trace_rank{rank}.jsonl"))
            plan.write(os.path.join(save, f"memory_plan_rank{rank}.json"), trace)
    else:
        plan = check_plan_setting(m.plan)
    layout = layout_from_plan(plan)
    arena = PlannedArena(layout, trainer.device)
    install_arena(trainer.model, arena)
    log.info("memory plan: arena of %.2f MiB for %d framework buffer slots and %d persistent buffers",
             layout.size_bytes / 2**20, len(layout.slots), len(layout.persistent))
    return arena
