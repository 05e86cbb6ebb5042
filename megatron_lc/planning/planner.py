"""Memory planner: an address for every request of a trace, peak near the max-live lower bound (Memo §4.2).

    trace = Trace.load("iter.jsonl")
    plan = plan_trace(trace, solver="cpsat", time_limit=10)   # bi-level when the trace has layer marks
    plan.write("plan.json")                                    # validated against the trace before writing

Flat: the whole trace is one DSA problem (``dsa.solve_dsa``: greedy largest-first warm start, then CP-SAT to improve or
prove; the paper's big-M MIP on HiGHS as ``solver="mip"``). Bi-level (``bilevel.py``): each layer block
(a run of events marked with one (layer, phase)) is planned once per distinct request sequence, then the
iteration is planned with every block as one request of its first-level peak.

Capacity mode (``plan_capacity``): is there a flat plan with its peak under a given number of bytes? Feasible (a
plan), infeasible (proved: the bound is above it, or the exact search of ``solver/placement_search.py`` was complete) or
undecided.

The plan format is in ``plan.py``; one DSA instance is solved by ``dsa.solve_dsa``.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..memory.arena import ALIGNMENT
from .bilevel import plan_bilevel
from .plan import Plan
from .solver.dsa import align_size, solve_dsa
from .solver.placement_search import FEASIBLE, INFEASIBLE, fit
from .solver.rects import Rects, best_greedy
from .trace import Trace


def flat_instance(trace: Trace, alignment: int) -> tuple[list, np.ndarray, Rects, np.ndarray]:
    """The trace as one DSA instance made only of what its overlap order and sizes define: times counted in runs
    of mallocs and frees (``Trace.overlap_times``), items sorted by (start, end, size descending, id). A trace and
    the MiniMalloc CSV it was written from, stretched, compressed or renumbered, give the same instance (up to which
    of two identical requests is which), so the same plan. Returns (requests in malloc order, their aligned sizes,
    the instance, ``order``): item k of the instance is request ``order[k]``."""
    reqs = trace.requests()
    sizes = np.array([align_size(r.size, alignment) for r in reqs], dtype=np.int64)
    start, end = (np.array(t, dtype=np.int64) for t in trace.overlap_times())
    order = np.lexsort((np.array([r.id for r in reqs], dtype=np.int64), -sizes, end, start))
    return reqs, sizes, Rects.flat(sizes[order], start[order], end[order]), order


def plan_flat(trace: Trace, *, solver: str = "auto", time_limit: float = 10.0, alignment: int = ALIGNMENT,
              workers: int = 2, orders=("size", "area", "lifetime", "start"), gap: float = 0.0) -> Plan:
    """The whole trace as one DSA problem (``flat_instance``)."""
    reqs, sizes, inst, order = flat_instance(trace, alignment)
    sol = solve_dsa(inst, solver=solver, time_limit=time_limit, workers=workers, names=[reqs[k].id for k in order],
                    orders=orders, gap=gap)
    offsets = np.empty(len(reqs), dtype=np.int64)
    offsets[order] = sol.offsets
    return Plan({r.id: int(o) for r, o in zip(reqs, offsets)}, {r.id: int(s) for r, s in zip(reqs, sizes)},
                [r.id for r in reqs], sol.peak, sol.lower_bound, sol.status, sol.solver, sol.seconds, alignment,
                {r.id: r.tag for r in reqs if r.tag}, dict(trace.meta.get("persistent", {})),
                {"mode": "flat", "requests": len(reqs)})


def plan_capacity(trace: Trace, capacity: int, *, time_limit: float = 10.0, alignment: int = ALIGNMENT
                  ) -> tuple[str, Optional[Plan]]:
    """The whole trace (flat) under ``capacity`` bytes: ("feasible", plan), ("infeasible", None) when the max-live
    bound exceeds it or the exact search proved that no plan fits, ("undecided", None) when time ran out. Greedy
    first; the exact search only when greedy does not fit."""
    t0 = time.perf_counter()
    reqs, sizes, inst, order = flat_instance(trace, alignment)
    lb = inst.lower_bound()
    if lb > capacity:
        return INFEASIBLE, None
    off, peak, greedy_order = best_greedy(inst, lower_bound=lb, time_limit=0.3 * time_limit)
    used = f"greedy-{greedy_order}"
    if peak > capacity:
        r = fit(inst, capacity, time_limit=time_limit - (time.perf_counter() - t0))
        if r.status != FEASIBLE:
            return r.status, None
        off, peak, used = r.offsets, inst.peak(r.offsets), used + "+search"
    offsets = np.empty(len(reqs), dtype=np.int64)
    offsets[order] = off
    plan = Plan({r.id: int(o) for r, o in zip(reqs, offsets)}, {r.id: int(s) for r, s in zip(reqs, sizes)},
                [r.id for r in reqs], peak, lb, "optimal" if peak == lb else "feasible", used,
                time.perf_counter() - t0, alignment, {r.id: r.tag for r in reqs if r.tag},
                dict(trace.meta.get("persistent", {})), {"mode": "capacity", "capacity_bytes": int(capacity)})
    plan.validate(trace)
    plan.arena = plan_arena(trace, alignment)
    return FEASIBLE, plan


def plan_trace(trace: Trace, *, mode: str = "auto", solver: str = "auto", time_limit: float = 10.0,
               alignment: int = ALIGNMENT, workers: int = 2, pseudo: str = "skyline", gap: float = 0.0) -> Plan:
    """Plan a trace. ``mode``: "bilevel" (needs layer marks), "flat", or "auto" (bi-level when the trace has
    layer blocks, flat otherwise); ``pseudo``: how a block enters the second level ("skyline" or the paper's
    "rectangle"); ``gap``: no solver time is spent on an instance whose greedy plan is within this relative gap of
    its lower bound. The plan is validated against the trace."""
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
        sub = plan_flat(trace.subset(r.id for r in tagged), solver="auto", time_limit=2.0, alignment=alignment,
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
