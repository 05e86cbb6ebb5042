/* The exact DSA search's inner loop in C99: a line-by-line twin of planning/solver/placement_search.py (_Search.run
 * and the restart loop of fit), loaded through ctypes by planning/solver/native.py; placement_search.py stays the
 * reference and fallback.
 *
 * Same semantics, node for node: candidates (min offset, preorder rank) in the same order, the same spatial
 * inference, dominance, hatless cut, decomposition (each part ranked anew among its own items when it starts)
 * and failed-state table (keys: 128-bit hashes of the unplaced items, their min offsets and ranks, plus the
 * canonical threshold), the same backjumps (dsa_blame.h; planning/solver/blame.py), the same node limits doubling per
 * round. Only the deadline differs (a node is ~100x cheaper here).
 *
 * A node's unplaced items are never copied: they are exactly the unplaced items whose first section lies in the
 * node's section range [lo, hi), a contiguous run of the items sorted by (first section, index) ("byfirst").
 * Example: items 0..2 with first sections 1, 0, 1 give byfirst = 1, 0, 2 and pf = {0, 1, 3}: a node over sections
 * [1, 2) scans byfirst[1:3], i.e. items 0 and 2, skipping the placed ones.
 */
#include "dsa_blame.h"

static int cmp_cand(const void *x, const void *y) {  /* (offset, rank), both ascending */
    const i64 *a = x, *b = y;
    if (a[0] != b[0]) return a[0] < b[0] ? -1 : 1;
    return a[1] < b[1] ? -1 : (a[1] > b[1]);
}

static int cmp_keyed(const void *x, const void *y) {  /* keys descending, then canonical position ascending */
    const struct Keyed *a = x, *b = y;
    for (int q = 0; q < 4; q++)
        if (a->k[q] != b->k[q]) return a->k[q] > b->k[q] ? -1 : 1;
    return a->canon < b->canon ? -1 : (a->canon > b->canon);
}

/* Rank the unplaced items of sections [lo, hi) among themselves by this run's preorder, T from the bytes still
 * unplaced per section; their previous ranks go on the arena as (item, old) pairs. search.py: Prepared.rank. */
static int rank_part(Ctx *c, int lo, int hi) {
    int m = 0;
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++) {
        i64 i = c->byfirst[q];
        if (c->placed[i]) continue;
        struct Keyed *e = &c->keyed[m++];
        i64 tmax = 0;
        for (i64 r = c->run_ptr[i]; r < c->run_ptr[i + 1]; r++)
            for (i64 s = c->run_lo[r]; s < c->run_hi[r]; s++) if (c->total[s] > tmax) tmax = c->total[s];
        for (int q2 = 0; q2 < 4; q2++) {
            i64 code = c->heur[q2];
            e->k[q2] = code == KEY_W ? c->width[i] : code == KEY_A ? c->area[i] : code == KEY_T ? tmax
                     : code == KEY_Z ? c->height[i] : code == KEY_V ? c->events[i] : 0;
        }
        e->item = i; e->canon = c->canon[i];
    }
    qsort(c->keyed, (size_t)m, sizeof *c->keyed, cmp_keyed);
    if (reserve(c, 2 * (size_t)m) != OK) return NOMEM;
    for (int k = 0; k < m; k++) {
        i64 i = c->keyed[k].item;
        c->arena[c->top++] = i; c->arena[c->top++] = c->rank[i];
        c->rank[i] = k;
    }
    return OK;
}

/* Fill ``f`` as the node for the unplaced items in sections [lo, hi) after a placement at (lo_o, lo_r): the
 * candidates on the arena (none when the state failed before or spatial inference fails). search.py: node(). */
static int make_node(Ctx *c, Set *failed, Frame *f, int lo, int hi, i64 lo_o, i64 lo_r) {
    memset(f, 0, sizeof *f);
    f->lo = lo; f->hi = hi; f->mark = f->cand_at = f->cand_end = c->top; f->j = f->o = -1;
    u64 h0 = 0x243f6a8885a308d3ULL, h1 = 0x13198a2e03707344ULL;
    i64 cnt = 0;
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++) {
        i64 i = c->byfirst[q];
        if (c->placed[i]) continue;
        h0 = mix(h0 ^ (u64)i) + (u64)c->minoff[i];
        h1 = mix(h1 + 0x9e3779b97f4a7c15ULL * ((u64)c->minoff[i] ^ ((u64)i << 40) ^ (u64)i)
                 + 0xd1b54a32d192ed03ULL * (u64)c->rank[i]);
        cnt++;
    }
    h0 = mix(h0 ^ (u64)lo_o) ^ mix((u64)lo_r + 0x632be59bd9b4e019ULL);
    h1 = mix(h1 + (u64)cnt) ^ mix((u64)lo_o * 0x85ebca6bULL + (u64)lo_r);
    f->key0 = h0; f->key1 = h1;
    if (set_has(failed, h0, h1)) {
        if (c->cbj) blame_all(c, c->sp - 1);
        return OK;
    }
    /* spatial inference: a section's unplaced items stack above their lowest min offset and above lo_o */
    i64 tmax = 0;
    for (int s = lo; s < hi; s++) {
        i64 tot = c->total[s];
        if (tot > tmax) tmax = tot;
        if (tot <= 0) continue;
        i64 floor = INT64_MAX;
        for (i64 m = c->ptr[s]; m < c->ptr[s + 1]; m++) {
            i64 i = c->members[m];
            if (!c->placed[i] && c->minoff[i] < floor) floor = c->minoff[i];
        }
        if ((floor > lo_o ? floor : lo_o) + tot > c->C) {
            if (c->cbj) {  /* each unplaced item is above C - tot: by a neighbour, or by the threshold */
                i64 D = c->C - tot;
                int thr = -2;
                memset(c->cur, 0, sizeof(u64) * (size_t)c->nw);
                for (i64 m = c->ptr[s]; m < c->ptr[s + 1]; m++) {
                    i64 i = c->members[m];
                    if (c->placed[i]) continue;
                    if (c->minoff[i] > D) blame(c, raiser(c, i, D + 1));
                    else if (thr == -2) blame(c, thr = passed(c, D));
                }
            }
            return OK;
        }
    }
    /* dominance: nothing at or above the lowest top an unplaced item reaches at its min offset */
    i64 mintop = INT64_MAX;
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++) {
        i64 i = c->byfirst[q];
        if (!c->placed[i] && c->minoff[i] + c->height[i] < mintop) mintop = c->minoff[i] + c->height[i];
    }
    if (reserve(c, 3 * (size_t)cnt) != OK) return NOMEM;
    i64 *out = c->arena + c->top;
    int nc = 0;
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++) {
        i64 i = c->byfirst[q], mo = c->minoff[i], rk = c->rank[i];
        if (c->placed[i] || mo >= mintop || mo > c->C - tmax || mo > c->ub[i]) continue;
        if (mo < lo_o || (mo == lo_o && rk <= lo_r)) continue;  /* canonical order after the last placement */
        out[3 * nc] = mo; out[3 * nc + 1] = rk; out[3 * nc + 2] = i; nc++;
    }
    if (!nc && c->cbj) blame_stuck(c, lo, hi, lo_o, lo_r);
    qsort(out, (size_t)nc, 3 * sizeof(i64), cmp_cand);
    c->top += 3 * (size_t)nc;
    f->ncand = nc; f->cand_end = c->top;
    return OK;
}

/* search.py: place(). The undo pairs go on the arena right after the node's candidates. */
static int place(Ctx *c, Frame *f, i64 j, i64 o) {
    c->top = f->cand_end;
    if (reserve(c, 2 * (size_t)(c->adj_ptr[j + 1] - c->adj_ptr[j])) != OK) return NOMEM;
    f->undo_at = c->top; f->nundo = 0; f->hatless = 1;
    for (i64 a = c->adj_ptr[j]; a < c->adj_ptr[j + 1]; a++) {
        i64 nb = c->adj_j[a], t = o + c->adj_e[a];
        if (c->placed[nb]) continue;
        f->hatless = 0;
        if (c->minoff[nb] < t) {
            c->arena[c->top++] = nb; c->arena[c->top++] = c->minoff[nb];
            c->minoff[nb] = t; f->nundo++;
        }
    }
    c->placed[j] = 1;
    for (i64 r = c->run_ptr[j]; r < c->run_ptr[j + 1]; r++)
        for (i64 s = c->run_lo[r]; s < c->run_hi[r]; s++) c->total[s] -= c->run_h[r];
    for (i64 s = c->span_lo[j]; s < c->span_hi[j] - 1; s++) c->cuts[s]--;
    f->j = j; f->o = o;
    return OK;
}

static void unplace(Ctx *c, Frame *f) {
    i64 j = f->j;
    for (int u = f->nundo - 1; u >= 0; u--) c->minoff[c->arena[f->undo_at + 2 * u]] = c->arena[f->undo_at + 2 * u + 1];
    for (i64 r = c->run_ptr[j]; r < c->run_ptr[j + 1]; r++)
        for (i64 s = c->run_lo[r]; s < c->run_hi[r]; s++) c->total[s] += c->run_h[r];
    for (i64 s = c->span_lo[j]; s < c->span_hi[j] - 1; s++) c->cuts[s]++;
    c->placed[j] = 0;
    f->j = -1; f->nundo = 0;
}

static int any_unplaced(const Ctx *c, int lo, int hi) {
    for (i64 q = c->pf[lo]; q < c->pf[hi]; q++)
        if (!c->placed[c->byfirst[q]]) return 1;
    return 0;
}

/* search.py: child(). Returns 0 (the partition is done), 1 (``nf`` is a node, maybe without candidates),
 * 2 (``nf`` is a decomposition into independent parts), or NOMEM. */
static int child(Ctx *c, Set *failed, Frame *f, Frame *nf) {
    if (!any_unplaced(c, f->lo, f->hi)) return 0;
    i64 lo_r = c->rank[f->j];
    int a = (int)(c->span_lo[f->j] > f->lo ? c->span_lo[f->j] : f->lo);
    int b = (int)(c->span_hi[f->j] - 1 < f->hi - 1 ? c->span_hi[f->j] - 1 : f->hi - 1);
    int nz = 0;
    for (int s = a; s < b; s++) nz += c->cuts[s] == 0;
    if (!nz) return make_node(c, failed, nf, f->lo, f->hi, f->o, lo_r) == OK ? 1 : NOMEM;
    if (reserve(c, 2 * ((size_t)nz + 1)) != OK) return NOMEM;
    size_t at = c->top;
    int np = 0, start = f->lo;
    for (int s = a; s <= b; s++) {
        int end = s < b ? (c->cuts[s] == 0 ? s + 1 : -1) : f->hi;
        if (end < 0) continue;
        if (any_unplaced(c, start, end)) {
            c->arena[at + 2 * np] = start; c->arena[at + 2 * np + 1] = end; np++;
        }
        start = end;
    }
    memset(nf, 0, sizeof *nf);
    nf->is_and = 1; nf->mark = at; nf->nparts = np; nf->last_o = f->o; nf->last_r = -1;
    c->top = at + 2 * (size_t)np;
    return 2;
}

/* One depth-first search with the preorder ``c->heur``: OK (c->sol holds the bases), FAIL or ABORT (node limit
 * or deadline) or NOMEM. search.py: _Search.run(), the same events travelling down the same stack. With
 * ``c->cbj`` a failure that does not blame a frame's placement passes it by (backjumping). */
static int run(Ctx *c, Frame *st, const i64 *parts, int nparts, Set *failed, i64 limit, double deadline,
               i64 *nodes) {
    memset(c->placed, 0, (size_t)c->n);
    memset(c->minoff, 0, (size_t)c->n * sizeof(i64));
    memset(c->rank, 0, (size_t)c->n * sizeof(i64));
    c->top = 0;
    c->st = st;
    *nodes = 0;
    if (reserve(c, 2 * (size_t)nparts) != OK) return NOMEM;
    memcpy(c->arena, parts, 2 * (size_t)nparts * sizeof(i64));
    int sp = 1;
    memset(st, 0, sizeof *st);
    st->is_and = 1; st->nparts = nparts; st->last_o = st->last_r = -1;
    c->top = 2 * (size_t)nparts;
    int ev = OK;  /* an and-frame starts its next part on OK */
    while (sp) {
        Frame *f = &st[sp - 1];
        int b = sp - 1;
        if (f->is_and) {
            if (ev == FAIL || f->next == f->nparts) {  /* a part failed, or all are solved: the event goes down */
                for (size_t q = c->top; q > f->mark + 2 * (size_t)f->nparts; q -= 2)  /* the parts' old ranks */
                    c->rank[c->arena[q - 2]] = c->arena[q - 1];
                c->top = f->mark; sp--;
                continue;
            }
            int lo = (int)c->arena[f->mark + 2 * f->next], hi = (int)c->arena[f->mark + 2 * f->next + 1];
            f->next++;
            if (rank_part(c, lo, hi) != OK) return NOMEM;
            c->sp = sp;
            if (make_node(c, failed, &st[sp], lo, hi, f->last_o, f->last_r) != OK) return NOMEM;
            if (c->cbj) memset(c->cs + (size_t)sp * c->nw, 0, sizeof(u64) * (size_t)c->nw);
            if (!st[sp].ncand) { ev = FAIL; continue; }
            sp++; ev = NEW;
            continue;
        }
        if (ev == OK) {  /* the subtree under this placement is solved: keep it, unwind */
            c->sol[f->j] = f->o;
            unplace(c, f);
            c->top = f->mark; sp--;
            continue;
        }
        if (ev == FAIL) {
            int hatless = f->hatless;
            if (c->cbj && !blamed(c, b)) { unplace(c, f); c->top = f->mark; sp--; continue; }  /* jump over */
            if (c->cbj) take_blame(c, b, f->j, f->o);
            unplace(c, f);
            if (hatless) {  /* nothing rests on it: no sibling helps */
                if (c->cbj) blame_all(c, b - 1);
                c->top = f->mark; sp--;
                continue;
            }
        }
        int got = -1;  /* what follows the current placement: 0 done, 1 node, 2 decomposition; -2 jump over,
                          -3 a placement nothing rests on failed (blame: every frame below) */
        while (f->k < f->ncand) {
            const i64 *cd = c->arena + f->cand_at + 3 * f->k++;
            if (++*nodes >= limit || ((*nodes & 127) == 0 && now() > deadline)) return ABORT;
            i64 j = cd[2], o = cd[0];
            if (place(c, f, j, o) != OK) return NOMEM;
            c->pframe[j] = b;
            c->sp = sp;
            got = child(c, failed, f, &st[sp]);
            if (got < 0) return NOMEM;
            if (c->cbj && got > 0) memset(c->cs + (size_t)sp * c->nw, 0, sizeof(u64) * (size_t)c->nw);
            if (got != 1 || st[sp].ncand) break;
            int hatless = f->hatless;
            if (c->cbj && !blamed(c, b)) { unplace(c, f); got = -2; break; }
            if (c->cbj) take_blame(c, b, j, o);
            unplace(c, f);
            got = -1;
            if (hatless) {
                if (c->cbj) blame_all(c, b - 1);
                got = -3;
                break;
            }
        }
        if (got == -2) { c->top = f->mark; sp--; ev = FAIL; continue; }
        if (f->j < 0) {  /* no candidate left: this state fails whenever it comes back */
            if (set_add(failed, f->key0, f->key1) != OK) return NOMEM;
            if (c->cbj && got != -3) memcpy(c->cur, c->cs + (size_t)b * c->nw, sizeof(u64) * (size_t)c->nw);
            c->top = f->mark; sp--;
            ev = FAIL;
            continue;
        }
        if (got == 0) { ev = OK; continue; }  /* the partition is complete: unwind on the next turn */
        sp++;
        ev = got == 2 ? OK : NEW;
    }
    return ev == OK ? OK : FAIL;
}

/* The restart loop of search.fit: runs in turn, the node limit doubling each round (starting from 2n), until one
 * is complete or ``time_limit`` seconds pass. Returns OK (``sol``), FAIL (proved infeasible: a run without
 * backjumping failed), ABORT (undecided) or NOMEM; ``nodes_out`` counts the placements tried. A backjumping run
 * that fails is not tried again (it proves nothing). Arrays as in sections.Prepared, flattened by
 * planning/solver/native.py; ``heur`` is H x 5: up to 4 letter codes (enum Key, -1 after the last: "WAT" is KEY_W, KEY_A,
 * KEY_T, -1), then 1 for a backjumping run, 0 for a plain one; ``parts`` the (lo, hi) section ranges of the
 * partitions. */
int dsa_fit(int n, int S, const i64 *height, const i64 *reach, const i64 *first, const i64 *span_lo,
            const i64 *span_hi, const i64 *run_ptr, const i64 *run_lo, const i64 *run_hi, const i64 *run_h,
            const i64 *total, const i64 *cuts, const i64 *adj_ptr, const i64 *adj_j, const i64 *adj_e,
            const i64 *members, const i64 *ptr, const i64 *byfirst, const i64 *pf, const i64 *width,
            const i64 *area, const i64 *events, const i64 *canon, const i64 *adj_rev, int nparts, const i64 *parts, int H,
            const i64 *heur, i64 capacity, double time_limit, i64 *sol, i64 *nodes_out) {
    double deadline = now() + time_limit;
    Ctx c = {.n = n, .S = S, .height = height, .first = first, .span_lo = span_lo, .span_hi = span_hi,
             .run_ptr = run_ptr, .run_lo = run_lo, .run_hi = run_hi, .run_h = run_h, .adj_ptr = adj_ptr,
             .adj_j = adj_j, .adj_e = adj_e, .members = members, .ptr = ptr, .byfirst = byfirst, .pf = pf,
             .width = width, .area = area, .events = events, .canon = canon, .C = capacity,
             .adj_rev = adj_rev};
    int rc = NOMEM;
    c.ub = malloc(sizeof(i64) * (size_t)(n + 1));
    c.minoff = malloc(sizeof(i64) * (size_t)(n + 1));
    c.total = malloc(sizeof(i64) * (size_t)(S + 1));
    c.cuts = malloc(sizeof(i64) * (size_t)(S + 1));
    c.sol = sol;
    c.placed = malloc((size_t)n + 1);
    c.rank = malloc(sizeof(i64) * (size_t)(n + 1));
    c.keyed = malloc(sizeof(struct Keyed) * (size_t)(n + 1));
    Frame *st = malloc(sizeof(Frame) * (size_t)(2 * n + 4));
    Set *failed = calloc((size_t)H, sizeof(Set));
    char *dropped = calloc((size_t)H + 1, 1);
    c.nw = (2 * n + 4 + 63) / 64;
    c.cs = calloc((size_t)c.nw * (size_t)(2 * n + 5), sizeof(u64));
    c.cur = calloc((size_t)c.nw, sizeof(u64));
    c.pframe = calloc((size_t)n + 1, sizeof(i64));
    *nodes_out = 0;
    if (!c.ub || !c.minoff || !c.total || !c.cuts || !c.placed || !c.rank || !c.keyed || !st || !failed || !dropped
        || !c.cs || !c.cur || !c.pframe) goto out;
    for (int i = 0; i < n; i++) c.ub[i] = capacity - reach[i];
    i64 limit = n;
    rc = ABORT;
    for (int active = H; active && now() < deadline;) {
        limit *= 2;
        for (int h = 0; h < H; h++) {
            if (dropped[h]) continue;
            memcpy(c.total, total, sizeof(i64) * (size_t)S);
            if (S > 1) memcpy(c.cuts, cuts, sizeof(i64) * (size_t)(S - 1));
            c.heur = heur + 5 * (size_t)h;
            c.cbj = heur[5 * (size_t)h + 4] == 1;
            i64 nodes = 0;
            int r = run(&c, st, parts, nparts, &failed[h], limit, deadline, &nodes);
            *nodes_out += nodes;
            if (r == FAIL && c.cbj) { dropped[h] = 1; active--; continue; }
            if (r != ABORT) { rc = r; goto out; }
            if (now() > deadline) break;
        }
    }
out:
    if (failed) for (int h = 0; h < H; h++) free(failed[h].keys);
    free(failed); free(dropped); free(st); free(c.keyed); free(c.rank); free(c.placed); free(c.cuts); free(c.total);
    free(c.minoff); free(c.ub); free(c.arena); free(c.cs); free(c.cur); free(c.pframe);
    return rc;
}
