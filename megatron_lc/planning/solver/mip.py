"""The paper's big-M MIP for the DSA problem (Memo §4.2), on HiGHS through ``scipy.optimize.milp``.

Why scipy and not ``highspy``: importing ``highspy`` and ``ortools`` in one process crashes (a libhighs symbol
clash, see DESIGN.md); scipy's bundled HiGHS does not clash. ``M_cap`` is the greedy peak (a valid upper bound that
keeps the big-M small), not the device capacity.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from .rects import Rects, size_unit


def mip(inst: Rects, *, lower_bound: int, upper_bound: int, time_limit: float
        ) -> tuple[Optional[np.ndarray], int, str]:
    """The paper's big-M MIP with scipy's HiGHS, M_cap = ``upper_bound``: min M s.t. A_i + S_i <= M and, for every
    pair of time-overlapping items, A_i + S_i <= A_j + z_ij M_cap and A_j + S_j <= A_i + (1 - z_ij) M_cap (for a
    shaped item, S is the height of its rectangle that overlaps the other's)."""
    unit = size_unit(np.concatenate([inst.height, [upper_bound]]))
    H = inst.height // unit
    n = inst.n
    cap = upper_bound // unit
    need: dict = {}  # (i, j), i < j -> (max height of i's rects overlapping j, max of j's overlapping i)
    ks = [k for k in range(len(H)) if H[k]]
    for a in range(len(ks)):
        for b in range(a + 1, len(ks)):
            k, l = ks[a], ks[b]
            i, j = int(inst.item[k]), int(inst.item[l])
            if i == j or not (inst.start[k] < inst.end[l] and inst.start[l] < inst.end[k]):
                continue
            if i > j:
                i, j, k, l = j, i, l, k
            hi, hj = need.get((i, j), (0, 0))
            need[(i, j)] = (max(hi, int(H[k])), max(hj, int(H[l])))
    pairs = list(need)
    ih = inst.item_height() // unit
    if inst.background is not None:
        top = np.zeros(n, dtype=np.int64)
        np.maximum.at(top, inst.item, inst.height + inst.extra)
        ih_peak = -(-top // unit)
    else:
        ih_peak = ih
    nv = n + 1 + len(pairs)  # A_0..A_{n-1}, M, z_e
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0
    for i in range(n):  # A_i - M <= -S_i
        rows += [r, r]; cols += [i, n]; vals += [1, -1]; lo.append(-np.inf); hi.append(-ih_peak[i]); r += 1
    for e, (i, j) in enumerate(pairs):
        si, sj = need[(i, j)]
        z = n + 1 + e
        rows += [r, r, r]; cols += [i, j, z]; vals += [1, -1, -cap]; lo.append(-np.inf); hi.append(-si); r += 1
        rows += [r, r, r]; cols += [j, i, z]; vals += [1, -1, cap]; lo.append(-np.inf); hi.append(cap - sj); r += 1
    A = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
    c = np.zeros(nv)
    c[n] = 1.0
    integrality = np.zeros(nv)
    integrality[n + 1:] = 1
    lb = np.zeros(nv)
    ub = np.concatenate([np.maximum(cap - ih, 0), [cap], np.ones(len(pairs))]).astype(float)
    lb[n] = -(-lower_bound // unit)
    res = milp(c, constraints=[LinearConstraint(A, lo, hi)], integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": float(time_limit), "disp": False})
    if res.x is None:
        return None, 0, "unknown" if res.status == 1 else f"failed ({res.message})"
    off = np.round(res.x[:n]).astype(np.int64) * unit
    return off, inst.peak(off), "optimal" if res.status == 0 else "feasible"
