"""One dynamic-storage-allocation instance solved: greedy largest-first warm start, then the exact search over
canonical placements (``capacity.minimize`` on ``search.fit``) and CP-SAT to improve or prove (the Memo paper's
big-M MIP on HiGHS as ``solver="mip"``); the result validated. The rectangles are ``solvers.Rects``.

Solvers: ``auto`` (the default): greedy; when it is above the max-live bound, the exact search; when that has not
proved its plan optimal and OR-Tools is installed (the ``planning`` extra), CP-SAT with the time left, hinted with
the best plan. ``search``: greedy and the exact search only. ``cpsat``: greedy and CP-SAT; named explicitly without
OR-Tools it is an error, never a silent greedy.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .capacity import minimize
from .mip import mip
from .rects import PlanError, Rects, best_greedy, cpsat, cpsat_bisect, validate

SOLVERS = ("auto", "greedy", "search", "cpsat", "mip")
SEARCH_SHARE = 0.6  # auto with OR-Tools: the exact search's share of the time left after greedy
CPSAT_BUILD_SECONDS_PER_RECT = 4e-4  # measured on this 2-core machine: ~3.5 s to build+presolve 10,000 boxes


def have_ortools() -> bool:
    return importlib.util.find_spec("ortools") is not None


def resolve_solver(solver: str) -> str:
    """``auto`` -> ``auto`` (greedy, search, then CP-SAT) or ``search`` without OR-Tools; ``cpsat`` without
    OR-Tools is a PlanError."""
    if solver not in SOLVERS:
        raise ValueError(f"solver {solver!r} is not one of {SOLVERS}")
    if solver == "auto":
        return "auto" if have_ortools() else "search"
    if solver == "cpsat" and not have_ortools():
        raise PlanError("solver cpsat needs OR-Tools, which is not installed (pip install 'megatron_lc[planning]'); "
                        "use solver auto or greedy")
    return solver


def align_size(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment if alignment > 1 else n



@dataclass
class Solution:
    offsets: np.ndarray
    peak: int
    lower_bound: int
    status: str  # "optimal" (proved: peak == lower bound or the solver's proof) | "feasible"
    solver: str
    seconds: float


def solve_dsa(inst: Rects, *, solver: str = "auto", time_limit: float = 10.0, workers: int = 2,
              names=None, orders=("size", "area", "lifetime", "start"), gap: float = 0.0,
              start: Optional[tuple] = None) -> Solution:
    """Plan one DSA instance: greedy warm start; stop if it is within ``gap`` (relative) of the max-live bound; else
    improve with ``solver`` within ``time_limit`` seconds. The result is validated (``names``: item names for the
    error message). ``start``: a plan known already, (offsets, peak) -- e.g. the capacity mode's at C -- used in
    place of greedy's when lower, so the result is never above it (the minimiser bisects below it)."""
    solver = resolve_solver(solver)
    t0 = time.perf_counter()
    lb = inst.lower_bound()
    off, peak, order = best_greedy(inst, orders, lower_bound=lb, time_limit=0.3 * time_limit)
    status, used = ("optimal" if peak == lb else "feasible"), f"greedy-{order}"
    if start is not None and start[1] < peak:
        off, peak, used = np.asarray(start[0], dtype=np.int64), int(start[1]), "start"
        status = "optimal" if peak == lb else "feasible"
    build = CPSAT_BUILD_SECONDS_PER_RECT * len(inst.item)  # model building is not covered by the solver's limit
    left = time_limit - (time.perf_counter() - t0)
    proved = lb  # no plan below this
    if peak > lb * (1 + gap) and solver in ("auto", "search") and inst.n:
        share = left * (SEARCH_SHARE if solver == "auto" else 1.0)
        off, peak, status, info = minimize(inst, lower_bound=lb, best=(off, peak), time_limit=share)
        proved, used = info["proved_lower_bound"], used + "+search"
        left = time_limit - (time.perf_counter() - t0)
        solver = "cpsat" if solver == "auto" and status != "optimal" else "done"  # CP-SAT: the fallback
    if peak > lb * (1 + gap) and solver in ("cpsat", "mip") and inst.n and left > 2 * build + 0.1:
        if solver == "cpsat":
            o, p, st = cpsat(inst, lower_bound=proved, upper_bound=peak, hint=off, time_limit=(left - build) / 2,
                             workers=workers)
            if o is not None and p <= peak:
                off, peak, status = o, p, st
            used += "+cpsat"
            left = time_limit - (time.perf_counter() - t0)
            if status != "optimal" and left > 2 * build + 0.2:
                off, peak, status = cpsat_bisect(inst, lower_bound=proved, best=(off, peak),
                                                 time_limit=left - build, workers=workers)
                used += "+bisect"
        else:
            o, p, st = mip(inst, lower_bound=lb, upper_bound=peak, time_limit=left)
            used += f"+mip({st})"
            if o is not None and p <= peak:
                off, peak, status = o, p, ("optimal" if st == "optimal" or p == lb else "feasible")
    names = names if names is not None else list(range(inst.n))
    validate([names[i] for i in inst.item], inst.height, inst.start, inst.end, off[inst.item], peak)
    return Solution(off, peak, lb, status, used, time.perf_counter() - t0)
