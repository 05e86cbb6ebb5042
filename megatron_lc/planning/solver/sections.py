"""The arrays the exact search (``search.py``) works on, prepared once per instance with numpy.

Sections: sweep the rectangles' start and end times; the set of rectangles live just before an end, when some rectangle
started since the previous end, is maximal, and every time's live set lies in one of them. These maximal cliques are
the *sections*, numbered in time order; each rectangle covers a contiguous range of them, and two rectangles overlap
in time exactly when their ranges intersect. Example: a [0, 4), b [1, 2), c [3, 6) give the sections {a, b} (before
b ends at 2) and {a, c} (before a ends at 4); {c} before 6 is no section (nothing started since 4, it lies in
{a, c}): a covers 0-1, b 0, c 1.

The sections, the cuts and the *events* key (the starts and ends in an item's sections) are the same for any times
that order the starts and ends alike (event positions of a trace, MiniMalloc's times, the same stretched or
compressed). The *lifetime* and *area* keys are in the instance's own time unit, as MiniMalloc's: the planner gives
the search times that count runs of mallocs and frees (``planner.flat_instance``), so that what reaches it from a
trace is only the overlap order and the sizes; the bi-level second level keeps the trace's event positions, where a
layer block's lifetime counts its inner events (which its rectangles do not show). Ties go by a canonical position
(first section, last section, height descending, area descending), never by index, so renumbering the items changes
nothing but which of two identical items is which.

Per item (a request, or a bi-level skyline of several rectangles on one base): its runs ``(lo, hi, height)`` over
sections, its span (first and last section), its height, its *reach* (height plus the background above it, so its
base may not exceed C - reach), and its neighbours with the *effective size* ``e``: when item i is at base o, a
neighbour placed above it starts at o + e or higher (e = the tallest rectangle of i overlapping the neighbour).
Per section: the bytes live in it. Per boundary between sections s and s + 1: the *cut*, the number of items
spanning both; a zero cut splits the instance into independent partitions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rects import Rects

_CHUNK = 1 << 21  # run pairs compared per numpy step
INF = np.iinfo(np.int64).max // 4  # above every offset


@dataclass
class Prepared:
    n: int  # items in the instance (zero-height ones are left out of everything below and end at base 0)
    S: int  # sections
    runs: list  # item -> [(lo, hi, height)]
    span: list  # item -> (first section, last section + 1)
    first: np.ndarray  # item -> first section
    height: np.ndarray  # item -> tallest rectangle
    reach: np.ndarray  # item -> max over its rectangles of height + background
    total: np.ndarray  # section -> bytes live in it
    cuts: np.ndarray  # boundary s (between sections s, s + 1) -> items spanning both
    adj: list  # item -> (neighbours, effective sizes), two int64 arrays
    members: np.ndarray  # the items covering each section, section by section
    ptr: np.ndarray  # section s's members are members[ptr[s]:ptr[s + 1]]
    partitions: list  # [(items, lo, hi)]: independent section ranges and their items
    area: np.ndarray  # item -> sum over its rectangles of height x duration
    width: np.ndarray  # item -> lifetime (last end - first start)
    events: np.ndarray  # item -> starts and ends of rectangles in the sections from its first to its last
    canon: np.ndarray  # item -> canonical position, the preorders' last key (see the module docstring)
    # the same facts flattened for the C core (native.py): runs and neighbours as CSR (item i's are [ptr[i],
    # ptr[i + 1])), and the items sorted by (first section, index), section s's starting at byfirst[pf[s]]
    run_ptr: np.ndarray
    run_lo: np.ndarray
    run_hi: np.ndarray
    run_h: np.ndarray
    adj_ptr: np.ndarray
    adj_j: np.ndarray
    adj_e: np.ndarray
    adj_rev: np.ndarray  # entry (i, j) -> the entry (j, i)
    byfirst: np.ndarray
    pf: np.ndarray

    def rank(self, heuristic: str, items: np.ndarray, total: np.ndarray) -> np.ndarray:
        """Preorder rank (0 first) of each of ``items`` among them: by the letters of ``heuristic`` in turn, each
        descending -- W lifetime, A area, V events, T the largest of ``total`` (bytes still unplaced per section)
        over the sections it covers, Z height -- then by canonical position. Example: heights 1, 2 on [0, 4),
        [1, 2): "WA" ranks item 0 first (longer), "Z" item 1."""
        tmax = np.array([max(int(total[lo:hi].max()) for lo, hi, _ in self.runs[i]) for i in items.tolist()],
                        dtype=np.int64).reshape(-1)
        keys = {"W": self.width[items], "A": self.area[items], "V": self.events[items], "T": tmax,
                "Z": self.height[items]}
        order = np.lexsort([self.canon[items]] + [-keys[c] for c in reversed(heuristic)])
        rank = np.empty(len(items), dtype=np.int64)
        rank[order] = np.arange(len(items))
        return rank


def prepare(inst: Rects) -> Prepared:
    keep = np.flatnonzero(inst.height > 0)
    ri, rs, re, rh = inst.item[keep], inst.start[keep], inst.end[keep], inst.height[keep]
    n = inst.n
    times = np.unique(np.concatenate([rs, re]))
    a, b = np.searchsorted(times, rs), np.searchsorted(times, re)
    is_sec = np.zeros(len(times), dtype=np.int64)
    # the slice [times[k], times[k + 1]) just before an end is a section when something started since the previous
    # end (at or after it: ends go first at one time); else its live set is a subset of the section before
    ends = np.unique(b)
    started = np.concatenate([[0], np.cumsum(np.bincount(a, minlength=len(times)))])
    since = np.concatenate([[0], ends[:-1]])
    is_sec[ends[started[ends] > started[since]] - 1] = 1
    csum = np.concatenate([[0], np.cumsum(is_sec)])
    lo, hi = csum[a], csum[b]
    S = int(csum[-1])

    runs: list = [[] for _ in range(n)]
    for i, l, h_, h in zip(ri.tolist(), lo.tolist(), hi.tolist(), rh.tolist()):
        runs[i].append((l, h_, h))
    span = [(min(r[0] for r in rr), max(r[1] for r in rr)) if rr else (0, 0) for rr in runs]
    height = np.zeros(n, dtype=np.int64)
    np.maximum.at(height, ri, rh)
    reach = np.zeros(n, dtype=np.int64)
    np.maximum.at(reach, ri, rh + inst.extra[keep])
    d = np.zeros(S + 1, dtype=np.int64)
    np.add.at(d, lo, rh)
    np.add.at(d, hi, -rh)
    total = np.cumsum(d)[:S]
    sp = np.array(span, dtype=np.int64).reshape(-1, 2)
    multi = sp[:, 1] - sp[:, 0] >= 2
    dc = np.zeros(S + 1, dtype=np.int64)
    np.add.at(dc, sp[multi, 0], 1)
    np.add.at(dc, sp[multi, 1] - 1, -1)
    cuts = np.cumsum(dc)[:max(S - 1, 0)]

    area = np.zeros(n, dtype=np.int64)
    np.add.at(area, ri, rh * (re - rs))
    first = np.full(n, np.iinfo(np.int64).max)
    last = np.zeros(n, dtype=np.int64)
    np.minimum.at(first, ri, rs)
    np.maximum.at(last, ri, re)
    width = np.where(height > 0, last - first, 0)
    ev = np.bincount(lo, minlength=S + 1) + np.bincount(hi - 1, minlength=S + 1)
    cev = np.concatenate([[0], np.cumsum(ev)])
    events = np.where(height > 0, cev[sp[:, 1]] - cev[sp[:, 0]], 0)
    canon = np.empty(n, dtype=np.int64)
    canon[np.lexsort((np.arange(n), -area, -height, sp[:, 1], sp[:, 0]))] = np.arange(n)

    adj_ptr, adj_j, adj_e = _neighbours(n, ri, lo, hi, rh)
    adj = [(adj_j[a:b], adj_e[a:b]) for a, b in zip(adj_ptr[:-1].tolist(), adj_ptr[1:].tolist())]
    by_item = np.argsort(ri, kind="stable")  # the runs in the order of ``runs``
    run_ptr = np.searchsorted(ri[by_item], np.arange(n + 1)).astype(np.int64)
    items = [i for i in range(n) if runs[i]]
    bounds = [0] + (np.flatnonzero(cuts == 0) + 1).tolist() + [S]
    groups: dict = {}
    for i in items:
        k = int(np.searchsorted(bounds, span[i][0], side="right")) - 1
        groups.setdefault(k, []).append(i)
    partitions = [(np.array(g, dtype=np.int64), bounds[k], bounds[k + 1]) for k, g in sorted(groups.items())]
    cover = hi - lo
    sec = np.repeat(lo, cover) + np.arange(int(cover.sum())) - np.repeat(np.cumsum(cover) - cover, cover)
    srt = np.argsort(sec, kind="stable")
    members = np.repeat(ri, cover)[srt]
    ptr = np.searchsorted(sec[srt], np.arange(S + 1))
    kept = np.flatnonzero(height > 0)
    byfirst = kept[np.lexsort((kept, sp[kept, 0]))]
    pf = np.searchsorted(sp[byfirst, 0], np.arange(S + 1)).astype(np.int64)
    own = np.repeat(np.arange(n), np.diff(adj_ptr))  # entries are sorted by (owner, neighbour)
    adj_rev = np.searchsorted(own * n + adj_j, adj_j * n + own).astype(np.int64)
    return Prepared(n, S, runs, span, sp[:, 0].copy(), height, reach, total, cuts, adj, members, ptr, partitions,
                    area, width, events, canon, run_ptr, lo[by_item], hi[by_item], rh[by_item], adj_ptr, adj_j, adj_e,
                    adj_rev, byfirst, pf)


def _neighbours(n: int, ri, lo, hi, rh) -> tuple:
    """(ptr, neighbour, effective size), item i's neighbours at [ptr[i], ptr[i + 1]): rectangles of two items
    overlap in time when their section ranges intersect; the effective size of i towards j is the tallest rectangle
    of i overlapping one of j's."""
    R = len(ri)
    order = np.argsort(lo, kind="stable")
    ri, lo, hi, rh = ri[order], lo[order], hi[order], rh[order]
    # with runs sorted by lo, the runs overlapping run k from the right are k+1 .. end(k) - 1, end(k) = first
    # run starting at or after hi[k]
    end = np.searchsorted(lo, hi, side="left")
    pi, pj, pe = [], [], []
    k0 = 0
    while k0 < R:  # chunks of runs whose pair counts fit in _CHUNK
        cnt = np.cumsum(np.maximum(end[k0:] - np.arange(k0 + 1, R + 1), 0))
        k1 = k0 + max(1, int(np.searchsorted(cnt, _CHUNK, side="right")))
        lens = np.maximum(end[k0:k1] - np.arange(k0 + 1, k1 + 1), 0)
        src = np.repeat(np.arange(k0, k1), lens)
        dst = np.arange(len(src)) - np.repeat(np.cumsum(lens) - lens, lens) + src + 1
        x, y = ri[src], ri[dst]
        ok = x != y
        x, y, hx, hy = x[ok], y[ok], rh[src][ok], rh[dst][ok]
        pi += [x, y]
        pj += [y, x]
        pe += [hx, hy]
        k0 = k1
    i, j, e = (np.concatenate(v) if v else np.zeros(0, dtype=np.int64) for v in (pi, pj, pe))
    if not len(i):
        return np.zeros(n + 1, dtype=np.int64), i, e
    key = i * n + j
    srt = np.lexsort((-e, key))  # per (i, j): the largest e first
    key, e = key[srt], e[srt]
    first = np.concatenate(([True], key[1:] != key[:-1]))
    key, e = key[first], e[first]
    i, j = key // n, key % n
    return np.searchsorted(i, np.arange(n + 1)).astype(np.int64), j, e
