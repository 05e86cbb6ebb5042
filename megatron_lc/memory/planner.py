"""Memory planner: an address for every request of a trace, peak near the max-live lower bound (Memo §4.2).

    trace = Trace.load("iter.jsonl")
    plan = plan_trace(trace, solver="cpsat", time_limit=10)   # bi-level when the trace has layer marks
    plan.write("plan.json")                                    # validated against the trace before writing

Flat: the whole trace is one DSA problem (``solve_dsa``: greedy largest-first warm start, then CP-SAT to improve or
prove; the paper's big-M MIP on HiGHS as ``solver="mip"``). Bi-level (``planner_bilevel``): each layer block
(a run of events marked with one (layer, phase)) is planned once per distinct request sequence, then the
iteration is planned with every block as one request of its first-level peak.

Plan JSON (public format, see docs/memory_planning.md)::

    {"format": "megatron_lc.plan/1", "peak_bytes": N, "lower_bound_bytes": N, "status": "optimal",
     "offsets": {"7": 0, ...}, "sizes": {"7": 8388608, ...}, "order": [7, ...], "tags": {"9": "mst.mlp_chunk"},
     "persistent": {"memo.round0": N}, "alignment": 512, "solver": "greedy+cpsat", "solve_seconds": 0.4,
     "levels": {...}}
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .arena import ALIGNMENT
from .planner_mip import mip
from .planner_solvers import PlanError, Rects, best_greedy, cpsat, cpsat_bisect, validate
from .trace import Trace

FORMAT = "megatron_lc.plan/1"
SOLVERS = ("greedy", "cpsat", "mip")
CPSAT_BUILD_SECONDS_PER_RECT = 4e-4  # measured on this 2-core machine: ~3.5 s to build+presolve 10,000 boxes


@dataclass
class Solution:
    offsets: np.ndarray
    peak: int
    lower_bound: int
    status: str  # "optimal" (proved: peak == lower bound or the solver's proof) | "feasible"
    solver: str
    seconds: float


def solve_dsa(inst: Rects, *, solver: str = "cpsat", time_limit: float = 10.0, workers: int = 2,
              names=None, orders=("size", "area", "lifetime", "start"), gap: float = 0.0) -> Solution:
    """Plan one DSA instance: greedy warm start; stop if it is within ``gap`` (relative) of the max-live bound; else
    improve with ``solver`` within ``time_limit`` seconds. The result is validated (``names``: item names for the
    error message)."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS}")
    t0 = time.perf_counter()
    lb = inst.lower_bound()
    off, peak, order = best_greedy(inst, orders, lower_bound=lb, time_limit=0.3 * time_limit)
    status, used = ("optimal" if peak == lb else "feasible"), f"greedy-{order}"
    build = CPSAT_BUILD_SECONDS_PER_RECT * len(inst.item)  # model building is not covered by the solver's limit
    left = time_limit - (time.perf_counter() - t0)
    if peak > lb * (1 + gap) and solver != "greedy" and inst.n and left > 2 * build + 0.1:
        if solver == "cpsat":
            o, p, st = cpsat(inst, lower_bound=lb, upper_bound=peak, hint=off, time_limit=(left - build) / 2,
                             workers=workers)
            if o is not None and p <= peak:
                off, peak, status = o, p, st
            used += "+cpsat"
            left = time_limit - (time.perf_counter() - t0)
            if status != "optimal" and left > 2 * build + 0.2:
                off, peak, status = cpsat_bisect(inst, lower_bound=lb, best=(off, peak), time_limit=left - build,
                                                 workers=workers)
                used += "+bisect"
        else:
            o, p, st = mip(inst, lower_bound=lb, upper_bound=peak, time_limit=left)
            used += f"+mip({st})"
            if o is not None and p <= peak:
                off, peak, status = o, p, ("optimal" if st == "optimal" or p == lb else "feasible")
    names = names if names is not None else list(range(inst.n))
    validate([names[i] for i in inst.item], inst.height, inst.start, inst.end, off[inst.item], peak)
    return Solution(off, peak, lb, status, used, time.perf_counter() - t0)


@dataclass
class Plan:
    """Offsets of every request of a trace (keys: trace ids), the peak, the max-live lower bound, the status."""

    offsets: dict
    sizes: dict
    order: list
    peak_bytes: int
    lower_bound_bytes: int
    status: str
    solver: str
    solve_seconds: float
    alignment: int = ALIGNMENT
    tags: dict = field(default_factory=dict)
    persistent: dict = field(default_factory=dict)
    levels: dict = field(default_factory=dict)
    arena: dict = field(default_factory=dict)  # framework buffers only: see plan_arena

    def to_json(self) -> dict:
        return {"format": FORMAT, "peak_bytes": self.peak_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "status": self.status, "solver": self.solver, "solve_seconds": round(self.solve_seconds, 4),
                "alignment": self.alignment, "offsets": {str(k): int(v) for k, v in self.offsets.items()},
                "sizes": {str(k): int(v) for k, v in self.sizes.items()}, "order": [int(i) for i in self.order],
                "tags": {str(k): v for k, v in self.tags.items()}, "persistent": dict(self.persistent),
                "levels": self.levels, "arena": self.arena}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if d.get("format", FORMAT) != FORMAT:
            raise PlanError(f"plan format {d.get('format')!r} is not {FORMAT!r}")
        for k in ("peak_bytes", "lower_bound_bytes", "offsets"):
            if k not in d:
                raise PlanError(f"plan has no {k!r}")
        offsets = {int(k): int(v) for k, v in d["offsets"].items()}
        sizes = {int(k): int(v) for k, v in d.get("sizes", {}).items()}
        return cls(offsets, sizes, [int(i) for i in d.get("order", offsets)], int(d["peak_bytes"]),
                   int(d["lower_bound_bytes"]), d.get("status", "unknown"), d.get("solver", "unknown"),
                   float(d.get("solve_seconds", 0.0)), int(d.get("alignment", ALIGNMENT)),
                   {int(k): v for k, v in d.get("tags", {}).items()}, dict(d.get("persistent", {})),
                   d.get("levels", {}), d.get("arena", {}))

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read plan {path}: {e}") from None
        return cls.from_json(d)

    def validate(self, trace: Trace) -> None:
        """Raise PlanError unless this plan places every request of ``trace`` with no two live ones overlapping."""
        reqs = trace.requests()
        missing = [r.id for r in reqs if r.id not in self.offsets]
        if missing:
            raise PlanError(f"plan has no offset for ids {missing[:5]}{'...' if len(missing) > 5 else ''}")
        sizes = np.array([align_size(r.size, self.alignment) for r in reqs], dtype=np.int64)
        for r, s in zip(reqs, sizes):
            if self.sizes and self.sizes.get(r.id, s) != s:
                raise PlanError(f"id {r.id}: plan size {self.sizes[r.id]} != trace size {s} (aligned)")
        validate([r.id for r in reqs], sizes, np.array([r.start for r in reqs]), np.array([r.end for r in reqs]),
                 np.array([self.offsets[r.id] for r in reqs], dtype=np.int64), self.peak_bytes)

    def write(self, path: str, trace: Trace) -> None:
        """Validate against ``trace``, then write the JSON."""
        self.validate(trace)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)


def align_size(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n


def plan_flat(trace: Trace, *, solver: str = "cpsat", time_limit: float = 10.0, alignment: int = ALIGNMENT,
              workers: int = 2, orders=("size", "area", "lifetime", "start"), gap: float = 0.0) -> Plan:
    """The whole trace as one DSA problem."""
    reqs = trace.requests()
    sizes = np.array([align_size(r.size, alignment) for r in reqs], dtype=np.int64)
    inst = Rects.flat(sizes, [r.start for r in reqs], [r.end for r in reqs])
    sol = solve_dsa(inst, solver=solver, time_limit=time_limit, workers=workers, names=[r.id for r in reqs],
                    orders=orders, gap=gap)
    return Plan({r.id: int(o) for r, o in zip(reqs, sol.offsets)}, {r.id: int(s) for r, s in zip(reqs, sizes)},
                [r.id for r in reqs], sol.peak, sol.lower_bound, sol.status, sol.solver, sol.seconds, alignment,
                {r.id: r.tag for r in reqs if r.tag}, dict(trace.meta.get("persistent", {})),
                {"mode": "flat", "requests": len(reqs)})


def plan_trace(trace: Trace, *, mode: str = "auto", solver: str = "cpsat", time_limit: float = 10.0,
               alignment: int = ALIGNMENT, workers: int = 2, pseudo: str = "skyline", gap: float = 0.0) -> Plan:
    """Plan a trace. ``mode``: "bilevel" (needs layer marks), "flat", or "auto" (bi-level when the trace has
    layer blocks, flat otherwise); ``pseudo``: how a block enters the second level ("skyline" or the paper's
    "rectangle"); ``gap``: no solver time is spent on an instance whose greedy plan is within this relative gap of
    its lower bound. The plan is validated against the trace."""
    from .planner_bilevel import plan_bilevel

    if mode not in ("auto", "bilevel", "flat"):
        raise ValueError(f"mode {mode!r} is not 'auto', 'bilevel' or 'flat'")
    if mode == "flat" or (mode == "auto" and not trace.blocks()):
        plan = plan_flat(trace, solver=solver, time_limit=time_limit, alignment=alignment, workers=workers, gap=gap)
    else:
        plan = plan_bilevel(trace, solver=solver, time_limit=time_limit, alignment=alignment, workers=workers,
                            pseudo=pseudo, gap=gap)
    reqs = trace.requests()
    plan.lower_bound_bytes = Rects.flat([align_size(r.size, alignment) for r in reqs], [r.start for r in reqs],
                                        [r.end for r in reqs]).lower_bound()
    if mode == "auto" and plan.levels.get("mode") == "bilevel" and plan.peak_bytes > plan.lower_bound_bytes * (1 + gap):
        t0 = time.perf_counter()  # a flat greedy is cheap (~1 s for 10,000 requests): keep the better plan
        flat = plan_flat(trace, solver="greedy", alignment=alignment, orders=("size",))
        plan.solve_seconds += time.perf_counter() - t0
        plan.levels["flat_greedy_peak_bytes"] = flat.peak_bytes
        if flat.peak_bytes < plan.peak_bytes:
            flat.levels, flat.solve_seconds = {**plan.levels, "chosen": "flat-greedy"}, plan.solve_seconds
            flat.lower_bound_bytes, plan = plan.lower_bound_bytes, flat
    if plan.peak_bytes == plan.lower_bound_bytes:
        plan.status = "optimal"
    elif plan.levels.get("mode") == "bilevel":
        plan.status = "feasible"  # each level may be optimal; the composition is not proved
    plan.validate(trace)
    plan.arena = plan_arena(trace, alignment, gap)
    return plan


def plan_arena(trace: Trace, alignment: int = ALIGNMENT, gap: float = 0.0) -> dict:
    """The ``arena`` section: the framework buffers of the trace (``tag``ged requests, planned compactly on their
    own -- on CPU only they live in the arena) and the persistent buffers (``trace.meta["persistent"]``, after
    the planned region). ``{"size_bytes": N, "slots": [[tag, k, offset, nbytes], ...], "persistent": [[tag,
    offset, nbytes], ...]}``; slot ``(tag, k)`` serves the k-th request of ``tag`` in an iteration."""
    tagged = [r for r in trace.requests() if r.tag]
    persistent = trace.meta.get("persistent", {})
    if not tagged and not persistent:
        return {}
    size = 0
    slots = []
    if tagged:
        sub = plan_flat(trace.subset(r.id for r in tagged), solver="cpsat", time_limit=2.0, alignment=alignment,
                        gap=gap)
        seen: dict = {}
        for r in tagged:
            k = seen.get(r.tag, 0)
            seen[r.tag] = k + 1
            slots.append([r.tag, k, sub.offsets[r.id], sub.sizes[r.id]])
        size = sub.peak_bytes
    pers = []
    for tag, n in sorted(persistent.items()):
        pers.append([tag, size, align_size(int(n), alignment)])
        size += align_size(int(n), alignment)
    return {"size_bytes": size, "slots": slots, "persistent": pers}
