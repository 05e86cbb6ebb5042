"""Bi-level plan (Memo §4.2, Figure 8).

A *layer block* is a maximal run of trace events marked with one (layer, phase). A request is *internal* to a block
when its malloc and its free both lie in the block (the paper's transient tensors); every other request (skeletal
tensors, gradients, outputs, anything outside layers) is *external*.

1. First level: the internal requests of one block form a DSA instance. Blocks whose internal request sequences are
   identical (same sizes, same order: identical layers) share one solution -- only one layer is planned.
2. Second level: the iteration with each block replaced by one pseudo request covering the block's time span with
   the block's first-level peak, plus all external requests. Internal offsets = block offset + first-level offset.

Example (Figure 9): 4 layers, fwd blocks F0..F3 and bwd blocks B3..B0, each with ~30 transient tensors; the first
level solves one F and one B instance; the second level sees 8 pseudo requests plus the skeletal tensors.

Guarantee: the second level is never worse than the baselines that keep each block's region separate:
``shared`` = externals planned alone (peak E) with all blocks at one region above them (E + max block peak; blocks
never overlap in time) and ``end_to_end`` = blocks laid end to end above the externals (E + sum of block peaks).
If the solver's second level were worse, the ``shared`` construction is used instead.
"""
from __future__ import annotations

import time

import numpy as np

from .plan import Plan
from .solver.dsa import align_size, solve_dsa
from .solver.rects import Rects, best_greedy
from .trace import Trace


def _block_index(trace: Trace, blocks: list) -> np.ndarray:
    pos = np.full(len(trace.events), -1, dtype=np.int64)
    for k, b in enumerate(blocks):
        pos[b.start:b.end] = k
    return pos


def skyline(starts: np.ndarray, ends: np.ndarray, tops: np.ndarray, t0: int, t1: int, max_runs: int = 32) -> list:
    """Runs ``(start, end, height)`` of the block's first-level top address over time ``[t0, t1)``: height(t) =
    max(offset + size) of its requests live at t. At most ``max_runs`` runs: beyond that, the adjacent pair whose
    merge (at the higher height) adds the least area is merged, repeatedly -- a coarser, still safe shape."""
    h = np.zeros(t1 - t0, dtype=np.int64)
    for s, e, top in zip(starts, ends, tops):
        np.maximum(h[s:e], top, out=h[s:e])
    cut = np.flatnonzero(np.diff(h)) + 1
    edges = np.concatenate(([0], cut, [len(h)]))
    runs = [[int(a), int(b), int(h[a])] for a, b in zip(edges[:-1], edges[1:])]
    while len(runs) > max_runs:
        cost = [max(x[2], y[2]) * (y[1] - x[0]) - x[2] * (x[1] - x[0]) - y[2] * (y[1] - y[0])
                for x, y in zip(runs, runs[1:])]
        k = int(np.argmin(cost))
        runs[k:k + 2] = [[runs[k][0], runs[k + 1][1], max(runs[k][2], runs[k + 1][2])]]
    return [(t0 + a, t0 + b, hh) for a, b, hh in runs if hh > 0]


def plan_bilevel(trace: Trace, *, solver: str = "auto", time_limit: float = 10.0, alignment: int = 512,
                 workers: int = 2, pseudo: str = "skyline", gap: float = 0.0) -> Plan:
    """Plan ``trace`` level by level; see the module docstring. ``pseudo``: "rectangle" (the paper: a block is one
    request of its first-level peak) or "skyline" (a block is a rigid shape of its first-level top over time)."""
    if pseudo not in ("skyline", "rectangle"):
        raise ValueError(f"pseudo {pseudo!r} is not 'skyline' or 'rectangle'")
    t0 = time.perf_counter()
    reqs = trace.requests()
    n_ev = len(trace.events)
    size = {r.id: align_size(r.size, alignment) for r in reqs}
    blocks = trace.blocks()
    where = _block_index(trace, blocks)
    internal: dict = {}
    external = []
    for r in reqs:
        b = int(where[r.start])
        if b >= 0 and r.end < n_ev and int(where[r.end]) == b:
            internal.setdefault(b, []).append(r)
        else:
            external.append(r)

    # external bytes live at each event position: the first level of a block keeps its transients low where the
    # externals are high, so that block + externals stay near the max-live bound at the second level
    d = np.zeros(n_ev + 1, dtype=np.int64)
    for r in external:
        d[r.start] += size[r.id]
        d[r.end] -= size[r.id]
    ext = np.cumsum(d)[:n_ev]

    # ---- first level: one DSA instance per distinct internal request sequence -------------------------------
    groups: dict = {}  # signature -> list of block indices
    local: dict = {}  # block index -> (requests in malloc order, local starts, local ends, event positions)
    for b, rs in internal.items():
        ids = {r.id for r in rs}
        pos = [n for n in range(blocks[b].start, blocks[b].end) if trace.events[n].id in ids]
        seq = [(trace.events[n].op, trace.events[n].id) for n in pos]
        rank = {rid: k for k, rid in enumerate(r.id for r in rs)}
        starts = np.zeros(len(rs), dtype=np.int64)
        ends = np.zeros(len(rs), dtype=np.int64)
        for t, (op, rid) in enumerate(seq):
            (starts if op == "malloc" else ends)[rank[rid]] = t
        local[b] = (rs, starts, ends, np.array(pos + [blocks[b].end], dtype=np.int64))
        sig = (blocks[b].phase, tuple((op, rank[rid], size[rid]) for op, rid in seq))
        groups.setdefault(sig, []).append(b)
    first = {}  # block index -> (offsets, block height)
    first_info = []
    budget = 0.4 * time_limit / max(len(groups), 1)
    for sig, bs in groups.items():
        crit = max(bs, key=lambda b: int(ext[blocks[b].start:blocks[b].end].max(initial=0)))
        rs, starts, ends, pos = local[crit]
        base = int(ext[blocks[crit].start:blocks[crit].end].min(initial=0))
        bg = np.array([ext[a:max(b, a + 1)].max() - base for a, b in zip(pos[:-1], pos[1:])], dtype=np.int64)
        inst = Rects.flat([size[r.id] for r in rs], starts, ends, background=bg if pseudo == "skyline" else None)
        sol = solve_dsa(inst, solver=solver, time_limit=budget, workers=workers, names=[r.id for r in rs], gap=gap)
        height = inst.top(sol.offsets)
        for b in bs:
            first[b] = (sol.offsets, height)
        plain_lb = Rects.flat([size[r.id] for r in rs], starts, ends).lower_bound()
        first_info.append({"phase": sig[0], "layers": [blocks[b].layer for b in bs], "requests": len(rs),
                           "peak_bytes": height, "lower_bound_bytes": plain_lb, "status": sol.status,
                           "with_externals_bytes": sol.peak, "with_externals_lower_bound": sol.lower_bound,
                           "solver": sol.solver, "seconds": round(sol.seconds, 4)})

    # ---- second level: external requests + one pseudo item per block ----------------------------------------
    pseudo_blocks = [b for b in sorted(first) if first[b][1] > 0]
    item, st, en, hh = [], [], [], []
    for k, r in enumerate(external):
        item.append(k); st.append(r.start); en.append(r.end); hh.append(size[r.id])
    for k, b in enumerate(pseudo_blocks):
        rs = local[b][0]
        if pseudo == "rectangle":
            runs = [(blocks[b].start, blocks[b].end, first[b][1])]
        else:
            runs = skyline(np.array([r.start for r in rs]) - blocks[b].start,
                           np.array([r.end for r in rs]) - blocks[b].start,
                           first[b][0] + np.array([size[r.id] for r in rs]), blocks[b].start, blocks[b].end)
        for a, e, h in runs:
            item.append(len(external) + k); st.append(a); en.append(e); hh.append(h)
    ne = len(external)
    inst = Rects(item, st, en, hh, ne + len(pseudo_blocks))
    names = [r.id for r in external] + [f"block{b}({blocks[b].phase} layer {blocks[b].layer})"
                                        for b in pseudo_blocks]
    left = max(time_limit - (time.perf_counter() - t0) - 0.5, 0.1)  # 0.5 s for composing and validating
    sol2 = solve_dsa(inst, solver=solver, time_limit=left, workers=workers, names=names, gap=gap)
    off2, peak2 = sol2.offsets, sol2.peak

    # baselines: blocks kept apart from the externals
    if ne:
        ext = Rects.flat([size[r.id] for r in external], [r.start for r in external], [r.end for r in external])
        ext_off, ext_peak, _ = best_greedy(ext, orders=("size",))
    else:
        ext_off, ext_peak = np.zeros(0, dtype=np.int64), 0
    block_peaks = [first[b][1] for b in pseudo_blocks]
    shared = ext_peak + max(block_peaks, default=0)
    end_to_end = ext_peak + sum(block_peaks)
    used = "solver"
    if peak2 > shared:
        off2 = np.concatenate([ext_off, np.full(len(pseudo_blocks), ext_peak, dtype=np.int64)])
        peak2, used = shared, "shared-baseline"

    offsets = {r.id: int(o) for r, o in zip(external, off2[:ne])}
    for k, b in enumerate(pseudo_blocks):
        for r, o in zip(local[b][0], first[b][0]):
            offsets[r.id] = int(off2[ne + k]) + int(o)
    for b in first:
        if b not in pseudo_blocks:  # blocks whose transients are all zero-size
            for r in local[b][0]:
                offsets[r.id] = 0
    levels = {"mode": "bilevel", "pseudo": pseudo, "blocks": len(blocks), "blocks_with_transients": len(internal),
              "distinct_blocks": len(groups), "internal_requests": sum(len(v) for v in internal.values()),
              "external_requests": ne, "first_level": first_info,
              "second_level": {"items": inst.n, "rectangles": len(item), "peak_bytes": int(peak2),
                               "lower_bound_bytes": sol2.lower_bound, "status": sol2.status, "solver": sol2.solver,
                               "used": used, "seconds": round(sol2.seconds, 4)},
              "baseline_shared_bytes": int(shared), "baseline_end_to_end_bytes": int(end_to_end)}
    return Plan(offsets, size, [r.id for r in reqs], int(peak2), 0, "feasible", f"bilevel-{pseudo}({solver})",
                time.perf_counter() - t0, alignment, {r.id: r.tag for r in reqs if r.tag},
                dict(trace.meta.get("persistent", {})), levels)
