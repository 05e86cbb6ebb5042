/* Backjumping for the exact DSA search's C core, the twin of planning/solver/blame.py: which frames (placements on the
 * stack) a failure blames, as bit sets of nw words (bit b: frame b). Included by dsa_search.c. */
#ifndef DSA_BLAME_H
#define DSA_BLAME_H
#include "dsa_search.h"

static void blame_all(Ctx *c, int upto) {  /* every frame up to ``upto``: a chronological backtrack */
    memset(c->cur, 0, sizeof(u64) * (size_t)c->nw);
    for (int b = 0; b <= upto; b++) c->cur[b >> 6] |= 1ULL << (b & 63);
}

static void blame(Ctx *c, int b) { if (b >= 0) c->cur[b >> 6] |= 1ULL << (b & 63); }

static int blamed(const Ctx *c, int b) { return (int)((c->cur[b >> 6] >> (b & 63)) & 1); }

/* the first frame that placed a neighbour of ``k`` reaching ``at_least`` or above k's base (-1: none) */
static int raiser(const Ctx *c, i64 k, i64 at_least) {
    int best = -1;
    for (i64 x = c->adj_ptr[k]; x < c->adj_ptr[k + 1]; x++) {
        i64 e = c->adj_j[x];
        if (!c->placed[e]) continue;
        int fe = (int)c->pframe[e];
        if (c->st[fe].o + c->adj_e[c->adj_rev[x]] >= at_least && (best < 0 || fe < best)) best = fe;
    }
    return best;
}

/* the first frame that placed above offset ``o`` (the threshold passed o there); else the last placement */
static int passed(const Ctx *c, i64 o) {
    int last = -1;
    for (int b = 0; b < c->sp; b++) {
        if (c->st[b].is_and) continue;
        if (c->st[b].o > o) return b;
        last = b;
    }
    return last;
}

/* a node without candidates though its sections fit: the stuck item (below the threshold) with the lowest top
 * needs a neighbour placed under its top; blamed: what made it stuck and what keeps its neighbours up */
static void blame_stuck(Ctx *c, int lo, int hi, i64 lo_o, i64 lo_r) {
    i64 ks = -1;
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++) {
        i64 i = c->byfirst[q], mo = c->minoff[i];
        if (c->placed[i] || !(mo < lo_o || (mo == lo_o && c->rank[i] <= lo_r))) continue;
        i64 t = mo + c->height[i], tk = ks < 0 ? 0 : c->minoff[ks] + c->height[ks];
        if (ks < 0 || t < tk || (t == tk && i < ks)) ks = i;
    }
    if (ks < 0) { blame_all(c, c->sp - 1); return; }
    i64 mo = c->minoff[ks], top = mo + c->height[ks];
    memset(c->cur, 0, sizeof(u64) * (size_t)c->nw);
    blame(c, passed(c, mo));
    if (mo > 0) blame(c, raiser(c, ks, mo));
    for (i64 x = c->adj_ptr[ks]; x < c->adj_ptr[ks + 1]; x++) {
        i64 z = c->adj_j[x], mz = c->minoff[z];
        if (c->placed[z]) continue;
        if (mz >= top) { blame(c, raiser(c, z, top)); continue; }
        blame(c, passed(c, mz));
        if (mz > 0) blame(c, raiser(c, z, mz));
    }
}

/* A failed placement (item j at o, frame b) hands its blame to its frame: the frame itself, where j's offset came
 * from instead (the neighbour it rests on). */
static void take_blame(Ctx *c, int b, i64 j, i64 o) {
    u64 *cs = c->cs + (size_t)b * c->nw;
    c->cur[b >> 6] &= ~(1ULL << (b & 63));
    if (o > 0) blame(c, raiser(c, j, o));
    for (int w = 0; w < c->nw; w++) cs[w] |= c->cur[w];
}

#endif
