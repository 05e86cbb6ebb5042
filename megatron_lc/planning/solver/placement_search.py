"""Exact search for the offline DSA problem: "do these rectangles fit under capacity C?", answered by a
branch-and-bound over canonical placements, after MiniMalloc ("MiniMalloc: A Lightweight Memory Allocator for
Hardware-Accelerated Machine Learning", ASPLOS 2023). Our own code; the ideas, each used below where it acts:

- **Canonical placements.** Every feasible plan can be pushed down until each item sits at 0 or on top of an item
  it conflicts with, and no item could jump down into a gap below it. Such a plan is produced by placing items
  one at a time, each at its *min offset* (the top of the placed items it conflicts with), in increasing
  (offset, preorder rank): the search branches only on which item goes next, never on an address.
- **Spatial inference.** A *section* is a maximal set of rectangles live at one time (a clique), so the items
  still unplaced in a section stack above its *floor* (the top of the last item placed there, and never below
  the current offset, which only grows): floor + their bytes > C prunes the branch.
- **Dominance.** An item whose offset is at or above the top of another unplaced item at its min offset would
  leave that item a gap to fall into: it is never placed next.
- **Decomposition.** Once every item crossing a section boundary is placed, the two sides are independent
  sub-problems, solved one after the other: a failure of one is never retried with other choices in the other.
  Each sub-problem is preordered anew among its own items, T from the bytes still unplaced in its sections (a
  part's T is no longer the whole instance's): without this, MiniMalloc's H and I stay undecided after millions of
  nodes; with it they take ~20,000.
- **Backjumping** (ours, ``blame.py``). A failure names the placements it blames, and the search passes by the
  levels whose placement is not blamed instead of trying their other candidates. Without it, a wrong placement
  low in one time region was undone only after every combination of later placements in other regions had
  failed: MiniMalloc's C, E, G and I, with their times counted in runs of mallocs and frees, stay undecided after
  a million nodes; with it the 11 take 1,206-55,560. Backjumping runs may pass a plan by (their blame is
  incomplete), so only a plain run's failure proves infeasibility.

Items may be rigid shapes (bi-level skylines: several rectangles sharing one base) and may carry a background
(``Rects.extra``: the item must stay below C - extra). ``fit`` answers feasible (with offsets), infeasible (the
search was complete) or undecided (out of time); ``minimize`` (in ``capacity.py``) builds the peak-minimising mode
on it. The instance arrays are prepared in ``sections.py``.
"""
from __future__ import annotations

import hashlib
import struct
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import native
from .blame import Blame
from .rects import Rects
from .sections import INF, Prepared, prepare

FEASIBLE, INFEASIBLE, UNDECIDED = "feasible", "infeasible", "undecided"
# preorders (each key descending, see Prepared.rank): W lifetime, A area, V events (in sections), T max unplaced
# section bytes. HEURISTICS: MiniMalloc's three, plain depth-first (complete: a failure proves infeasibility);
# BACKJUMP: the runs that jump over placements a failure does not blame (blame.py), tried first in each round.
HEURISTICS = ("WAT", "TAW", "TWA")
BACKJUMP = ("WAT", "TAW", "TWA", "TVA")
RUNS = tuple((h, True) for h in BACKJUMP) + tuple((h, False) for h in HEURISTICS)
_OK, _FAIL, _NEW, _ABORT = 0, 1, 2, 3


@dataclass
class Fit:
    status: str  # FEASIBLE | INFEASIBLE | UNDECIDED
    offsets: Optional[np.ndarray]  # item bases when FEASIBLE
    nodes: int  # placements tried
    seconds: float


class _Node:
    """One level of the search inside a partition (a range of sections): its unplaced items, the candidates
    (min offset, item) in the order they are tried, and the placement being explored below it."""

    __slots__ = ("items", "lo", "hi", "cands", "key", "k", "j", "o", "undo", "hatless", "cs")

    def __init__(self, items, lo, hi, cands, key=b""):
        self.items, self.lo, self.hi, self.cands, self.key, self.k = items, lo, hi, cands, key, 0
        self.j = self.o = -1
        self.undo = None
        self.hatless = False
        self.cs = 0  # backjumping: the frames its failed children blamed (bit b: stack frame b)


class _And:
    """Independent partitions that must all be solved (decomposition); solved left to right, each ranked anew when
    it starts (``saved``: the ranks it replaced, put back when the decomposition is left)."""

    __slots__ = ("parts", "next", "last", "saved")
    o = None  # no placement (Blame.passed skips it)

    def __init__(self, parts, last):
        self.parts, self.next, self.last, self.saved = parts, 0, last, []


class _Search(Blame):
    def __init__(self, p: Prepared, capacity: int):
        self.p, self.C = p, int(capacity)
        self.ub = self.C - p.reach  # highest base of each item under C (its background included)

    def reset(self):
        p = self.p
        self.minoff = np.zeros(p.n, dtype=np.int64)
        self.placed = np.zeros(p.n, dtype=bool)
        self.total = p.total.copy()
        self.cuts = p.cuts.copy()
        self.sol = np.zeros(p.n, dtype=np.int64)
        self.pframe = np.zeros(p.n, dtype=np.int64)
        self.cur = 0

    def node(self, items, lo, hi, last) -> _Node:
        """The node for ``items`` (unplaced) in sections [lo, hi) after a placement at (offset, rank) ``last``.
        No candidates when spatial inference fails; else the items that may go next, sorted by (offset, rank)."""
        p, C, mo_all = self.p, self.C, self.minoff
        lo_o, lo_r = last
        # what follows depends only on the items, their min offsets and ranks and ``last``: a state that failed
        # before (in this preorder, maybe in an earlier round) fails again
        key = hashlib.blake2b(items.tobytes() + mo_all[items].tobytes() + self.rank[items].tobytes()
                              + struct.pack("qq", lo_o, lo_r),
                              digest_size=16).digest()
        if key in self.failed:
            if self.cbj:
                self.blame_all(self.sp - 1)
            return _Node(items, lo, hi, [])
        a = p.ptr[lo]
        mem = p.members[a:p.ptr[hi]]
        # spatial inference: the unplaced items of a section are one clique, so they stack above the lowest min
        # offset among them, and above the last offset (offsets only grow along a branch)
        floor = np.minimum.reduceat(np.where(self.placed[mem], INF, mo_all[mem]), p.ptr[lo:hi] - a)
        tot = self.total[lo:hi]
        over = np.where(tot > 0, np.maximum(floor, lo_o) + tot, 0) > C
        if over.any():
            if self.cbj:
                s = int(np.argmax(over))
                self.blame_section(lo + s, int(tot[s]))
            return _Node(items, lo, hi, [])
        mo, rk = mo_all[items], self.rank[items]
        # dominance: an item at or above the top another unplaced item reaches at its min offset would leave it a
        # gap to fall into; canonical order: (offset, rank) after ``last``; and whatever goes next at o leaves
        # every section's unplaced bytes above o
        sel = ((mo < (mo + p.height[items]).min()) & (mo <= C - int(tot.max())) & (mo <= self.ub[items])
               & ((mo > lo_o) | ((mo == lo_o) & (rk > lo_r))))
        idx = np.flatnonzero(sel)
        if not len(idx) and self.cbj:
            self.blame_stuck(items, (mo < lo_o) | ((mo == lo_o) & (rk <= lo_r)))
        idx = idx[np.lexsort((rk[idx], mo[idx]))]
        return _Node(items, lo, hi, list(zip(mo[idx].tolist(), items[idx].tolist())), key)

    def place(self, f: _Node, j: int, o: int) -> None:
        """Put item ``j`` at ``o``: raise its unplaced neighbours' min offsets, take its bytes out of its sections'
        totals and its span's cuts; the undo goes in ``f``."""
        p, mo = self.p, self.minoff
        nb, eff = p.adj[j]
        free = ~self.placed[nb]
        t = o + eff
        up = free & (mo[nb] < t)
        changed = nb[up]
        old = mo[changed]
        mo[changed] = t[up]
        self.placed[j] = True
        for lo, hi, h in p.runs[j]:
            self.total[lo:hi] -= h
        sl, sh = p.span[j]
        self.cuts[sl:sh - 1] -= 1
        f.j, f.o, f.undo, f.hatless = j, o, (changed, old), not free.any()

    def unplace(self, f: _Node):
        p, j = self.p, f.j
        changed, old = f.undo
        self.minoff[changed] = old
        for lo, hi, h in p.runs[j]:
            self.total[lo:hi] += h
        sl, sh = p.span[j]
        self.cuts[sl:sh - 1] += 1
        self.placed[j] = False
        f.undo = None

    def child(self, f: _Node):
        """What follows the placement in ``f``: None (the partition is done), a node, or an ``_And`` of the
        independent parts when cuts in the placed item's span dropped to zero."""
        j = f.j
        items = f.items[f.items != j]
        if not len(items):
            return None
        last = (f.o, int(self.rank[j]))
        sl, sh = self.p.span[j]
        a, b = max(sl, f.lo), min(sh - 1, f.hi - 1)
        zeros = (np.flatnonzero(self.cuts[a:b] == 0) + a + 1).tolist() if b > a else []
        if not zeros:
            return self.node(items, f.lo, f.hi, last)
        starts = [f.lo] + zeros
        where = np.searchsorted(starts, self.p.first[items], side="right") - 1
        parts = [(items[where == k], s, e) for k, (s, e) in enumerate(zip(starts, zeros + [f.hi]))]
        parts = [q for q in parts if len(q[0])]
        # even a single part is ranked anew (its T changed). Its ranks do not compare with ``last``'s, but offsets
        # still only grow: every item goes at f.o or above, in any rank order
        return _And(parts, (f.o, -1))

    def run(self, heuristic: str, failed: set, node_limit: int, deadline: float, backjump: bool = False) -> int:
        """One depth-first search with the preorder ``heuristic`` (letters of ``Prepared.rank``): _OK (``self.sol``
        holds the bases), _FAIL (no placement exists; with ``backjump``: none was found, see blame.py) or _ABORT
        (node limit or deadline). Iterative: an explicit stack of nodes and decompositions."""
        self.reset()
        self.heuristic, self.failed, self.cbj = heuristic, failed, backjump
        self.rank = np.zeros(self.p.n, dtype=np.int64)  # each item's rank within its part, set when the part starts
        self.nodes = 0
        self.stack = stack = [_And(self.p.partitions, (-1, -1))]
        ev = _OK  # an _And starts its next part on _OK
        while stack:
            f = stack[-1]
            b = len(stack) - 1
            if isinstance(f, _And):
                if ev == _FAIL or f.next == len(f.parts):
                    for items, old in reversed(f.saved):
                        self.rank[items] = old
                    stack.pop()  # one part failed: the decomposition fails; all solved: _OK travels down
                    continue
                items, lo, hi = f.parts[f.next]
                f.saved.append((items, self.rank[items]))
                self.rank[items] = self.p.rank(self.heuristic, items, self.total)
                self.sp = len(stack)
                nxt = self.node(items, lo, hi, f.last)
                f.next += 1
                if not nxt.cands:
                    ev = _FAIL
                    continue
                stack.append(nxt)
                ev = _NEW
                continue
            if ev == _OK:  # the subtree under this node's placement is solved: keep it, unwind
                self.sol[f.j] = f.o
                self.unplace(f)
                stack.pop()
                continue
            if ev == _FAIL:
                hatless = f.hatless
                if backjump and not self.cur >> b & 1:  # not blamed: pass this frame by
                    self.unplace(f)
                    stack.pop()
                    continue
                if backjump:
                    self.take_blame(f, b, f.j, f.o)
                self.unplace(f)
                if hatless:  # nothing rests on the item: no other choice here makes room for the rest
                    if backjump:
                        self.blame_all(b - 1)
                    stack.pop()
                    continue
            nxt, chrono = False, False
            while f.k < len(f.cands):
                o, j = f.cands[f.k]
                f.k += 1
                self.nodes += 1
                if self.nodes >= node_limit or (self.nodes & 127 == 0 and time.perf_counter() > deadline):
                    return _ABORT
                self.place(f, j, o)
                self.pframe[j] = b
                self.sp = len(stack)
                nxt = self.child(f)
                if nxt is None or isinstance(nxt, _And) or nxt.cands:
                    break
                hatless = f.hatless
                if backjump and not self.cur >> b & 1:
                    self.unplace(f)
                    nxt = "jump"
                    break
                if backjump:
                    self.take_blame(f, b, j, o)
                self.unplace(f)
                if hatless:
                    if backjump:
                        self.blame_all(b - 1)
                    chrono = True
                    break
            if nxt == "jump":
                stack.pop()
                ev = _FAIL
                continue
            if f.undo is None:  # no candidate left
                self.failed.add(f.key)
                if backjump and not chrono:
                    self.cur = f.cs
                stack.pop()
                ev = _FAIL
                continue
            if nxt is None:
                ev = _OK  # the partition is complete: unwind on the next turn
            else:
                stack.append(nxt)
                ev = _OK if isinstance(nxt, _And) else _NEW
        return _OK if ev == _OK else _FAIL


BACKENDS = ("auto", "native", "python")


def fit(inst: Rects, capacity: int, *, time_limit: float = 10.0, prepared: Optional[Prepared] = None,
        backend: str = "auto") -> Fit:
    """Place every item of ``inst`` with all its rectangles (plus background) below ``capacity``, or prove that
    none exists, within ``time_limit`` seconds. The runs of ``RUNS`` are tried in turn with a node limit that doubles
    each round (a lucky order finishes early): the backjumping ones first (a failed one is not tried again: it
    proves nothing), then the plain depth-first ones (complete: a failure proves infeasibility).

    ``backend``: "native" (the C twin of ``_Search``, ``native.py``; NativeUnavailable when it cannot be built),
    "python" (this module), "auto" (native when it loads). Both try the same nodes in the same order, so they give
    the same answer and plan; they differ only in speed (a C node is ~100x cheaper), hence in what a deadline
    leaves undecided. Example: ``fit(Rects.flat([4] * 5, [0, 3, 0, 9, 0], [3, 9, 9, 21, 21]), 12).status``
    is "feasible" on both, and ``.nodes`` is the same."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    p = prepared if prepared is not None else prepare(inst)
    if p.n == 0:
        return Fit(FEASIBLE, np.zeros(inst.n, dtype=np.int64), 0, 0.0)
    s = _Search(p, capacity)
    if int(s.ub.min()) < 0 or int(p.total.max(initial=0)) > capacity:
        return Fit(INFEASIBLE, None, 0, time.perf_counter() - t0)
    lib = native.load() if backend != "python" else None
    if backend == "native" and lib is None:
        raise native.NativeUnavailable(native.why_not())
    if lib is not None:
        code, sol, nodes = native.fit_native(lib, p, capacity, RUNS, deadline - time.perf_counter())
        status = {native.OK: FEASIBLE, native.FAIL: INFEASIBLE}.get(code, UNDECIDED)
        return Fit(status, sol if code == native.OK else None, nodes, time.perf_counter() - t0)
    limit, nodes = p.n, 0
    failed: list = [set() for _ in RUNS]  # per run: hashes of the states whose search failed
    active = list(range(len(RUNS)))
    while active and time.perf_counter() < deadline:
        limit *= 2
        for h in list(active):
            heuristic, backjump = RUNS[h]
            r = s.run(heuristic, failed[h], limit, deadline, backjump)
            nodes += s.nodes
            if r == _OK:
                return Fit(FEASIBLE, s.sol.copy(), nodes, time.perf_counter() - t0)
            if r == _FAIL and backjump:
                active.remove(h)
                continue
            if r == _FAIL:
                return Fit(INFEASIBLE, None, nodes, time.perf_counter() - t0)
            if time.perf_counter() > deadline:
                break
    return Fit(UNDECIDED, None, nodes, time.perf_counter() - t0)
