"""Solvers of the offline DSA problem: place rectangles (fixed time span x size) at addresses, minimising the peak.

Instances are ``Rects``: items (requests, or bi-level blocks as rigid skyline shapes) made of rectangles
(half-open time interval of event positions x height in bytes). Output: an offset per item and the peak.

- ``greedy``: largest-first, each request at the lowest address free over its whole lifetime (first fit);
  ``best_greedy`` tries four orders and keeps the best. O(n^2) with numpy: ~1 s for 10,000 requests.
- ``cpsat``: OR-Tools CP-SAT, ``AddNoOverlap2D`` over (time interval, address interval), greedy as hint and the
  max-live bound as the peak's lower bound, so reaching it proves optimality. ``capacity=`` turns it into a
  feasibility question ("fit under C"), which ``cpsat_bisect`` uses between the lower bound and the best peak.
- ``mip`` (mip.py): the paper's big-M MIP (Memo §4.2) on HiGHS through ``scipy.optimize.milp`` (scipy's
  HiGHS does not clash with ortools, unlike ``highspy``), with the greedy peak as ``M_cap``.
- ``validate``: a sweep over time with the live address intervals kept sorted; raises ``PlanError`` naming the pair.
"""
from __future__ import annotations

import bisect
import logging
import math
import time
from functools import reduce
from typing import Optional

import numpy as np

log = logging.getLogger("megatron_lc")


class PlanError(ValueError):
    """An invalid plan (two live tensors overlap, an offset out of range)."""


def size_unit(sizes: np.ndarray) -> int:
    """The largest unit every non-zero size is a multiple of (their gcd; 1 for none): solvers count in it."""
    nz = [int(s) for s in sizes if s > 0]
    return reduce(math.gcd, nz) if nz else 1


class Rects:
    """A DSA instance of *items*, each a rigid shape of one or more rectangles sharing the item's base address:
    rectangle k of item ``item[k]`` occupies time ``[start[k], end[k])`` and addresses
    ``[base + 0, base + height[k])``. A plain request is one rectangle; a bi-level block is its skyline (its
    first-level peak over time), one rectangle per run of equal height."""

    def __init__(self, item, start, end, height, n_items: Optional[int] = None,
                 background: Optional[np.ndarray] = None):
        self.item, self.start, self.end, self.height = (np.asarray(a, dtype=np.int64) for a in
                                                        (item, start, end, height))
        self.n = int(n_items if n_items is not None else (self.item.max() + 1 if len(self.item) else 0))
        # optional load on top at each time (bytes, indexed by time): the objective becomes
        # max over rectangles of (base + height + max background over the rectangle's span)
        self.background = background
        self.extra = np.zeros(len(self.item), dtype=np.int64)
        if background is not None and len(self.item):
            self.extra = np.array([background[a:b].max(initial=0) for a, b in zip(self.start, self.end)],
                                  dtype=np.int64)

    @classmethod
    def flat(cls, sizes, starts, ends, background=None) -> "Rects":
        return cls(np.arange(len(sizes)), starts, ends, sizes, len(sizes), background)

    def lower_bound(self) -> int:
        """Max over time of the live heights plus the background (the max-live bound of the instance)."""
        if not len(self.height):
            return 0
        T = int(self.end.max()) + 1
        d = np.zeros(T + 1, dtype=np.int64)
        np.add.at(d, self.start, self.height)
        np.add.at(d, self.end, -self.height)
        live = np.cumsum(d)[:T]
        if self.background is not None:
            live = live + np.pad(self.background, (0, max(T - len(self.background), 0)))[:T]
        return int(max(live.max(), 0))

    def item_height(self) -> np.ndarray:
        h = np.zeros(self.n, dtype=np.int64)
        np.maximum.at(h, self.item, self.height)
        return h

    def item_span(self) -> tuple[np.ndarray, np.ndarray]:
        s = np.full(self.n, np.iinfo(np.int64).max)
        e = np.zeros(self.n, dtype=np.int64)
        np.minimum.at(s, self.item, self.start)
        np.maximum.at(e, self.item, self.end)
        return s, e

    def peak(self, offsets: np.ndarray) -> int:
        """The objective: max of base + height (+ background on top) over the rectangles."""
        return int((offsets[self.item] + self.height + self.extra).max(initial=0))

    def top(self, offsets: np.ndarray) -> int:
        """The highest address used (no background)."""
        return int((offsets[self.item] + self.height).max(initial=0))


def greedy(inst: Rects, order: np.ndarray) -> tuple[np.ndarray, int]:
    """Place items in ``order``, each at the lowest base where none of its rectangles overlaps a placed rectangle
    live at the same time (first fit). Returns (item offsets, peak).

    For item rectangle k and a placed rectangle j overlapping it in time, the base b is forbidden in the open
    interval (off_j - h_k, off_j + h_j); the answer is the smallest b >= 0 outside all of them (one sort)."""
    off = np.zeros(inst.n, dtype=np.int64)
    rects_of = np.split(np.argsort(inst.item, kind="stable"), np.cumsum(np.bincount(inst.item, minlength=inst.n))[:-1])
    R = len(inst.item)
    ps, pe, plo, phi = (np.zeros(R, dtype=np.int64) for _ in range(4))  # placed rectangles, compact
    p = 0
    for i in order:
        ks = rects_of[i]
        ks = ks[inst.height[ks] > 0]
        if not len(ks):
            continue
        st, en, h = inst.start[ks], inst.end[ks], inst.height[ks]
        if p:
            if len(ks) == 1:
                idx = np.flatnonzero((ps[:p] < en[0]) & (pe[:p] > st[0]))
                lo, hi = plo[idx] - h[0], phi[idx]
            else:
                m = (ps[None, :p] < en[:, None]) & (pe[None, :p] > st[:, None])
                kk, idx = np.nonzero(m)
                lo, hi = plo[idx] - h[kk], phi[idx]
        else:
            lo = hi = np.zeros(0, dtype=np.int64)
        if lo.size:
            srt = np.argsort(lo, kind="stable")
            lo, hi = lo[srt], hi[srt]
            pm = np.maximum.accumulate(hi)
            prev = np.concatenate(([0], pm[:-1]))
            ok = np.flatnonzero(lo >= prev)
            off[i] = prev[ok[0]] if ok.size else max(int(pm[-1]), 0)
        q = p + len(ks)
        ps[p:q], pe[p:q], plo[p:q], phi[p:q] = st, en, off[i], off[i] + h
        p = q
    return off, inst.peak(off)


def greedy_orders(inst: Rects) -> dict:
    h = inst.item_height()
    s, e = inst.item_span()
    life = e - s
    area = np.zeros(inst.n)
    np.add.at(area, inst.item, inst.height.astype(np.float64) * (inst.end - inst.start))
    return {
        "size": np.lexsort((s, -life, -h)),  # largest first, then longest-lived, then earliest
        "area": np.lexsort((s, -h, -area)),
        "lifetime": np.lexsort((s, -h, -life)),
        "start": np.lexsort((-h, s)),  # online first-fit order
    }


def best_greedy(inst: Rects, orders=("size", "area", "lifetime", "start"), lower_bound: Optional[int] = None,
                time_limit: Optional[float] = None) -> tuple[np.ndarray, int, str]:
    """The best of the greedy orders: (item offsets, peak, order name); stops at the first order that reaches
    ``lower_bound``, and tries no further order once ``time_limit`` seconds have passed."""
    t0 = time.perf_counter()
    all_orders = greedy_orders(inst)
    best = None
    for name in orders:
        off, peak = greedy(inst, all_orders[name])
        if best is None or peak < best[1]:
            best = (off, peak, name)
        if lower_bound is not None and peak <= lower_bound:
            break
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            break
    return best


def cpsat(inst: Rects, *, lower_bound: int, upper_bound: int, hint: Optional[np.ndarray], time_limit: float,
          workers: int = 2, capacity: Optional[int] = None) -> tuple[Optional[np.ndarray], int, str]:
    """CP-SAT on the instance: one base variable per item, one (time, address) box per rectangle,
    ``AddNoOverlap2D``. Minimise the peak in ``[lower_bound, upper_bound]`` or, with ``capacity``, find any
    placement under it. Returns (item offsets or None, peak, "optimal" | "feasible" | "infeasible" | "unknown")."""
    # OR-Tools is optional (the ``planning`` extra): without it ``solve_dsa`` keeps the greedy plan
    from ortools.sat.python import cp_model

    unit = size_unit(np.concatenate([inst.height, [lower_bound, upper_bound]]))
    cap = (capacity if capacity is not None else upper_bound) // unit
    m = cp_model.CpModel()
    peak = m.NewIntVar(-(-lower_bound // unit), cap, "peak")
    ih = inst.item_height() // unit
    base = [m.NewIntVar(0, max(cap - int(ih[i]), 0), f"b{i}") for i in range(inst.n)]
    xs, ys = [], []
    for k in range(len(inst.item)):
        hk = int(inst.height[k]) // unit
        if hk == 0:
            continue
        i = int(inst.item[k])
        xs.append(m.NewFixedSizeIntervalVar(int(inst.start[k]), int(inst.end[k] - inst.start[k]), f"t{k}"))
        ys.append(m.NewFixedSizeIntervalVar(base[i], hk, f"a{k}"))
        if inst.background is not None:
            m.Add(base[i] + hk + -(-int(inst.extra[k]) // unit) <= peak)
    for i in range(inst.n):
        m.Add(base[i] + int(ih[i]) <= peak)
        if hint is not None:
            m.AddHint(base[i], int(hint[i]) // unit)
    m.AddNoOverlap2D(xs, ys)
    if hint is not None:  # a complete hint (the peak too), so the hinted placement is a first solution
        m.AddHint(peak, max(-(-inst.peak(hint) // unit), -(-lower_bound // unit)))
    if capacity is None:
        m.Minimize(peak)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(max(time_limit, 0.01))
    solver.parameters.num_workers = workers
    st = solver.Solve(m)
    name = {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible", cp_model.INFEASIBLE: "infeasible"}.get(
        st, "unknown")
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, 0, name
    off = np.array([solver.Value(b) * unit for b in base], dtype=np.int64)
    if capacity is not None and name == "optimal":
        name = "feasible"  # a satisfiability answer, not a proof about the peak
    return off, inst.peak(off), name


def cpsat_bisect(inst: Rects, *, lower_bound: int, best: tuple, time_limit: float,
                 workers: int = 2) -> tuple[np.ndarray, int, str]:
    """Bisection on capacity between ``lower_bound`` and the best known peak, each step a CP-SAT feasibility
    question with the best placement as hint. Returns (offsets, peak, status)."""
    off, peak = best
    lo = lower_bound
    unit = size_unit(np.concatenate([inst.height, [lower_bound]]))
    deadline = time.perf_counter() + time_limit
    while peak - lo >= unit and time.perf_counter() < deadline:
        mid = (lo + peak) // 2 // unit * unit
        if mid < lo:
            mid = lo
        left = deadline - time.perf_counter()
        o, p, st = cpsat(inst, lower_bound=lower_bound, upper_bound=peak, hint=off,
                         time_limit=min(left, max(left / 3, 0.5)), workers=workers, capacity=mid)
        if o is not None:
            off, peak = o, p
        elif st == "infeasible":
            lo = mid + unit
        else:
            break  # undecided within its time: stop bisecting
    return off, peak, "optimal" if peak <= lo else "feasible"


def validate(ids, sizes, starts, ends, offsets, peak: int) -> None:
    """Raise PlanError unless every request lies in ``[0, peak)`` and no two time-overlapping requests share an
    address. Sweep over time; the live address intervals are disjoint, so checking neighbours suffices."""
    n = len(sizes)
    for i in range(n):
        if offsets[i] < 0 or offsets[i] + sizes[i] > peak:
            raise PlanError(f"id {ids[i]}: [{offsets[i]}, {offsets[i] + sizes[i]}) outside [0, {peak})")
    ev = sorted([(int(ends[i]), 0, i) for i in range(n) if sizes[i]] + [(int(starts[i]), 1, i) for i in range(n)
                                                                        if sizes[i]])
    los: list = []  # sorted offsets of live requests
    who: list = []
    for _, kind, i in ev:
        o, e = int(offsets[i]), int(offsets[i] + sizes[i])
        k = bisect.bisect_left(los, o)
        if kind == 0:  # free (ends sort before starts at the same time: [s, e) half open)
            while who[k] != i:
                k += 1
            del los[k], who[k]
            continue
        if k > 0 and los[k - 1] + int(sizes[who[k - 1]]) > o:
            j = who[k - 1]
            raise PlanError(f"ids {ids[j]} and {ids[i]} overlap: [{los[k - 1]}, {los[k - 1] + sizes[j]}) and "
                            f"[{o}, {e}) while both live")
        if k < len(los) and los[k] < e:
            j = who[k]
            raise PlanError(f"ids {ids[i]} and {ids[j]} overlap: [{o}, {e}) and [{los[k]}, {los[k] + sizes[j]}) "
                            "while both live")
        los.insert(k, o)
        who.insert(k, i)
