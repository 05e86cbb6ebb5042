"""Backjumping for the exact search (``search.py``; its C twin: ``csrc/dsa_blame.h``): which placements a failure
blames, so that the search passes by the frames it does not blame instead of trying their other candidates.

The stack frames are numbered from the root (frame b's placement is the item it put down, ``stack[b].o`` its offset;
a decomposition has none); a set of frames is an int, bit b for frame b. Example: a section holding more unplaced
bytes than fit above the items' lowest base blames, for each unplaced item, the first frame that put a neighbour
of it that high; if those are frames 3 and 7, a failure found at frame 12 goes back to frame 7 directly.
"""
from __future__ import annotations

import numpy as np

from .sections import INF, Prepared


class Blame:
    """Backjumping (conflict-directed, after Prosser's "Hybrid algorithms for the constraint satisfaction problem"):
    a failure names the frames of the stack (placements) it blames, as the bits of ``cur``; a frame whose placement
    is not blamed is passed by, its other candidates untried. A node without candidates blames: for a section whose
    unplaced bytes do not fit, for each of its unplaced items the first placement of a neighbour reaching above C
    minus those bytes, or the first placement above that offset (the threshold); for an item stuck under the
    threshold (the one with the lowest top), what made it stuck and what keeps its neighbours above its top; for
    anything else (a failed state, a placement nothing rests on) every frame. A failed placement hands its blame to
    its frame, with the neighbour it rested on instead of itself. The blame of a node left without candidates omits
    what kept other items from being candidates, so a backjumping run may pass a plan by: it finds plans (valid
    ones), it never proves there is none."""

    # set by the search (search._Search) that mixes this in, besides its instance state (C, placed, minoff)
    p: Prepared
    stack: list
    sp: int  # the stack index of the node being made
    cur: int  # the frames the failure on its way blames
    pframe: np.ndarray  # placed item -> the frame that placed it

    def raiser(self, k: int, at_least: int) -> int:
        """The first frame that placed a neighbour of ``k`` reaching ``at_least`` or more above k's base; -1: none."""
        p, best = self.p, -1
        for x in range(int(p.adj_ptr[k]), int(p.adj_ptr[k + 1])):
            e = int(p.adj_j[x])
            if self.placed[e]:
                fe = int(self.pframe[e])
                if self.stack[fe].o + int(p.adj_e[p.adj_rev[x]]) >= at_least and (best < 0 or fe < best):
                    best = fe
        return best

    def passed(self, o: int) -> int:
        """The first frame that placed above offset ``o`` (the threshold passed o there); else the last placement."""
        last = -1
        for b in range(self.sp):
            fo = self.stack[b].o
            if fo is not None:  # a placement, not a decomposition
                if fo > o:
                    return b
                last = b
        return last

    def blame(self, *frames: int) -> None:
        for b in frames:
            if b >= 0:
                self.cur |= 1 << b

    def blame_all(self, upto: int) -> None:
        self.cur = (1 << (upto + 1)) - 1

    def blame_section(self, s: int, tot: int) -> None:
        """Section ``s`` holds ``tot`` unplaced bytes over C: each unplaced item is above C - tot, raised there by a
        neighbour or by the threshold."""
        p, D, thr = self.p, self.C - tot, None
        self.cur = 0
        for i in p.members[p.ptr[s]:p.ptr[s + 1]].tolist():
            if self.placed[i]:
                continue
            if self.minoff[i] > D:
                self.blame(self.raiser(i, D + 1))
            elif thr is None:
                thr = self.passed(D)
                self.blame(thr)

    def blame_stuck(self, items: np.ndarray, stuck: np.ndarray) -> None:
        """No candidates though every section fits: the stuck item with the lowest top (then lowest index) needs a
        neighbour placed under its top."""
        if not stuck.any():
            self.blame_all(self.sp - 1)
            return
        top = self.minoff[items] + self.p.height[items]
        ks = int(items[np.lexsort((items, np.where(stuck, top, INF)))[0]])
        mo, p = int(self.minoff[ks]), self.p
        top = mo + int(p.height[ks])
        self.cur = 0
        self.blame(self.passed(mo))
        if mo > 0:
            self.blame(self.raiser(ks, mo))
        for z in p.adj_j[p.adj_ptr[ks]:p.adj_ptr[ks + 1]].tolist():
            mz = int(self.minoff[z])
            if self.placed[z]:
                continue
            if mz >= top:
                self.blame(self.raiser(z, top))
                continue
            self.blame(self.passed(mz))
            if mz > 0:
                self.blame(self.raiser(z, mz))

    def take_blame(self, f, b: int, j: int, o: int) -> None:
        """Placement (j at o) of frame ``b`` failed: its blame, with j's raiser for b, goes into the frame's."""
        self.cur &= ~(1 << b)
        if o > 0:
            self.blame(self.raiser(j, o))
        f.cs |= self.cur
