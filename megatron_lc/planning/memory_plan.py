"""``memory.plan: off | auto | <plan.json>`` at run time: ``MemoryPlan``, the last technique runtime setup runs
before FSDP2 and the optimizer.

- ``off``: framework buffers are plain allocations (the model context's ``ArenaHandle`` holds a plain ``Arena``).
- ``auto``: one forward + backward of a micro-batch of the training shape is traced (``capture_iteration``; the RNG
  state is restored and the gradients cleared, so training is unchanged), planned (``plan_trace``, time limit
  ``memory.plan_time_limit``, no solver time once within 0.1% of the lower bound), logged (planning seconds, peak,
  lower bound, simulated caching-allocator reserved), and the framework buffers are served from a
  ``PlannedArena`` built from the plan's ``arena`` section.
- ``<plan.json>``: a plan written by ``tools/plan_memory.py`` or an earlier ``auto`` run; its ``arena`` section is
  installed the same way. (On GPU, ``replay_cuda`` can replay the whole plan through a pluggable allocator; that
  must happen before any CUDA allocation and was never executed here.)

With ``save_dir`` (``checkpoint.save``), ``auto`` writes ``memory_trace_rank{r}.jsonl`` and
``memory_plan_rank{r}.json`` there.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch

from ..config import ConfigError
from ..memory.arena import ArenaHandle, ArenaLayout, PlannedArena, Slot
from .cachesim import simulate
from .capture.record import capture_iteration
from .plan import Plan
from .planner import plan_trace
from .solver.dsa import have_ortools
from .solver.rects import PlanError

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


def _profile(model, arena: ArenaHandle, batch: dict, autocast, rank: int, device: torch.device):
    """Trace one forward + backward on ``batch``; RNG states restored and gradients cleared afterwards."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    t0 = time.perf_counter()
    trace = capture_iteration(model, batch, arena, meta={"rank": rank}, autocast=autocast)
    seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return trace, seconds


class MemoryPlan:
    """``memory.plan`` (``auto`` or a plan file) as a technique runtime (``compose/context.py``), the last in setup
    order: ``bind`` (the arena's device), ``calibrate`` (a plan file: loaded; ``auto``: what the trace will need --
    a micro-batch of the training shape, the autocast, the rank, the time limit and ``checkpoint.save``),
    ``allocate`` (``auto``: that micro-batch traced with every other runtime's buffers in place, and planned; then
    the ``PlannedArena`` installed in the model context's ``arena``). ``planned``: that arena once allocated."""

    TAG = "plan"

    def __init__(self, setting: str, arena: ArenaHandle):
        self.setting, self.arena = setting, arena
        self.device: Optional[torch.device] = None
        self.plan: Optional[Plan] = None
        self.planned: Optional[PlannedArena] = None
        self._trace_inputs = None

    def bind(self, device: torch.device) -> None:
        self.device = device

    def calibrate(self, model, env) -> None:
        """``env``: the run's ``compose.Calibration``."""
        if self.setting == "auto":
            self._trace_inputs = (model, env)
        else:
            self.plan = check_plan_setting(self.setting)

    def allocate(self) -> None:
        if self.plan is None:
            self.plan = self._plan_a_trace(*self._trace_inputs)
            self._trace_inputs = None
        layout = layout_from_plan(self.plan)
        self.planned = PlannedArena(layout, self.device)
        self.arena.install(self.planned)
        log.info("memory plan: arena of %.2f MiB for %d framework buffer slots and %d persistent buffers",
                 layout.size_bytes / 2**20, len(layout.slots), len(layout.persistent))

    def _plan_a_trace(self, model, env) -> Plan:
        rank, save_dir = env.topo.rank, env.cfg.checkpoint.save
        trace, prof_s = _profile(model, self.arena, env.batch(), env.execution.autocast, rank, self.device)
        plan = plan_trace(trace, time_limit=env.cfg.memory.plan_time_limit, gap=AUTO_GAP)
        if not have_ortools():
            log.info("memory plan (auto): greedy and the exact search only; OR-Tools (pip install "
                     "'megatron_lc[planning]') would add CP-SAT where the search is undecided")
        sim = simulate(trace)
        log.info("memory plan (auto): profiled %d requests in %.2fs, planned in %.2fs: peak %.2f MiB, lower bound "
                 "%.2f MiB (x%.4f), %s, %s; caching allocator would reserve %.2f MiB (x%.3f of the plan)",
                 len(plan.offsets), prof_s, plan.solve_seconds, plan.peak_bytes / 2**20,
                 plan.lower_bound_bytes / 2**20, plan.peak_bytes / max(plan.lower_bound_bytes, 1), plan.status,
                 plan.solver, sim.peak_reserved_bytes / 2**20, sim.peak_reserved_bytes / max(plan.peak_bytes, 1))
        if save_dir:
            os.makedirs(save_dir, exist_ok=True)
            trace.dump(os.path.join(save_dir, f"memory_trace_rank{rank}.jsonl"))
            plan.write(os.path.join(save_dir, f"memory_plan_rank{rank}.json"), trace)
        return plan
