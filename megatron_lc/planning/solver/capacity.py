"""The peak-minimising mode of the exact search (``search.fit`` answers "fits under C?").

Start at the max-live lower bound, where most instances are solved (ours and the published hard ones): a plan
there is optimal. Otherwise bisect between the highest capacity proved infeasible (or the bound) and the best peak
known, each step a feasibility search with a share of the time left; a plan found under ``mid`` lowers the upper
end to its own peak, an infeasible answer raises the lower end, an undecided one is skipped over (the gap below it
stays unproved).
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .placement_search import FEASIBLE, INFEASIBLE, fit
from .rects import Rects, size_unit
from .sections import Prepared, prepare

FIRST_SHARE = 0.5  # of the time limit, for the question "fits at the lower bound?"


def minimize(inst: Rects, *, lower_bound: int, best: tuple, time_limit: float,
             prepared: Optional[Prepared] = None) -> tuple[np.ndarray, int, str, dict]:
    """Lower the peak of ``best`` = (offsets, peak) towards ``lower_bound`` within ``time_limit`` seconds. Returns
    (offsets, peak, "optimal" | "feasible", info) where info counts the searches, nodes and the proved bound."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    off, peak = best
    p = prepared if prepared is not None else prepare(inst)
    unit = size_unit(np.concatenate([inst.height, inst.extra, [lower_bound]]))
    proved = lower_bound  # no plan below this
    lo = lower_bound  # next capacity worth asking
    info = {"searches": 0, "nodes": 0}
    first = True
    while lo < peak and time.perf_counter() < deadline:
        left = deadline - time.perf_counter()
        mid = lo if first else max(lo, (lo + peak - unit) // 2 // unit * unit)
        r = fit(inst, mid, time_limit=FIRST_SHARE * left if first else max(left / 3, min(left, 0.2)), prepared=p)
        first = False
        info["searches"] += 1
        info["nodes"] += r.nodes
        if r.status == FEASIBLE:
            off, peak = r.offsets, inst.peak(r.offsets)
        elif r.status == INFEASIBLE:  # so is every capacity below mid
            lo = proved = mid + unit
        else:
            lo = mid + unit  # undecided: look higher, the gap below stays open
    info["proved_lower_bound"] = int(max(proved, lower_bound))
    return off, peak, "optimal" if peak <= proved else "feasible", info
