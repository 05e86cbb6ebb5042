/* Types and helpers of the exact DSA search's C core (dsa_search.c): the search state (Ctx), stack frames, the
 * failed-state set (128-bit keys, open addressing) and the LIFO arena. */
#ifndef DSA_SEARCH_H
#define DSA_SEARCH_H
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef long long i64;
typedef uint64_t u64;

enum { OK = 0, FAIL = 1, NEW = 2, ABORT = 3, NOMEM = -1 };

typedef struct {
    int n, S;
    const i64 *height, *first, *span_lo, *span_hi, *run_ptr, *run_lo, *run_hi, *run_h;
    const i64 *adj_ptr, *adj_j, *adj_e, *members, *ptr, *byfirst, *pf;
    const i64 *width, *area, *events, *canon;
    i64 C, *ub, *minoff, *total, *cuts, *sol;
    i64 *rank;                     /* each item's rank in the preorder of the part it belongs to */
    const i64 *heur;               /* this run's preorder: up to 4 letter codes (Key), -1 after the last */
    struct Keyed *keyed;           /* scratch for ranking a part */
    char *placed;
    i64 *arena; size_t top, cap;   /* cands (o, rank, item), undo (item, old), parts (lo, hi), saved ranks
                                      (item, old): LIFO */
    /* backjumping (dsa_blame.h; planning/solver/blame.py): sets of frames as bit words, nw words a set */
    int cbj, nw, sp;               /* this run backjumps; the stack index of the node being made */
    const i64 *adj_rev;            /* adjacency entry (i, j) -> the entry (j, i) */
    struct Frame *st;
    i64 *pframe;                   /* placed item -> the frame that placed it */
    u64 *cs, *cur;                 /* per frame: what its failed children blamed; what the failure going down
                                      blames */
} Ctx;

enum Key { KEY_W, KEY_A, KEY_T, KEY_Z, KEY_V };  /* lifetime, area, largest unplaced section total, height,
                                                     events (sections.Prepared.rank) */

struct Keyed { i64 k[4]; i64 canon, item; };

typedef struct Frame {
    int is_and, lo, hi;
    size_t mark;                   /* arena top when the frame was made: restored when it is popped */
    /* node */
    size_t cand_at, cand_end, undo_at; int ncand, k, nundo, hatless; i64 j, o; u64 key0, key1;
    /* and */
    int nparts, next; i64 last_o, last_r;
} Frame;

typedef struct { u64 *keys; size_t cap, cnt; } Set;  /* open addressing, (k0, k1) pairs, (0, 0) = empty */

static u64 mix(u64 x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdULL; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL; x ^= x >> 33;
    return x;
}

static int set_has(const Set *s, u64 a, u64 b) {
    if (!s->cap) return 0;
    for (size_t i = a & (s->cap - 1);; i = (i + 1) & (s->cap - 1)) {
        if (s->keys[2 * i] == a && s->keys[2 * i + 1] == b) return 1;
        if (!s->keys[2 * i] && !s->keys[2 * i + 1]) return 0;
    }
}

static int set_add(Set *s, u64 a, u64 b) {
    if (2 * (s->cnt + 1) > s->cap) {  /* keep the load under 1/2 */
        Set g = {calloc(2 * (s->cap ? 2 * s->cap : 1024), sizeof(u64)), s->cap ? 2 * s->cap : 1024, 0};
        if (!g.keys) return NOMEM;
        for (size_t i = 0; i < s->cap; i++)
            if (s->keys[2 * i] || s->keys[2 * i + 1]) set_add(&g, s->keys[2 * i], s->keys[2 * i + 1]);
        free(s->keys);
        *s = g;
    }
    size_t i = a & (s->cap - 1);
    while (s->keys[2 * i] || s->keys[2 * i + 1]) {
        if (s->keys[2 * i] == a && s->keys[2 * i + 1] == b) return OK;
        i = (i + 1) & (s->cap - 1);
    }
    s->keys[2 * i] = a; s->keys[2 * i + 1] = b; s->cnt++;
    return OK;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* room for ``slots`` more values on the arena; NOMEM when it cannot grow */
static int reserve(Ctx *c, size_t slots) {
    if (c->top + slots <= c->cap) return OK;
    size_t cap = c->cap ? c->cap : 1 << 16;
    while (cap < c->top + slots) cap *= 2;
    i64 *a = realloc(c->arena, cap * sizeof(i64));
    if (!a) return NOMEM;
    c->arena = a; c->cap = cap;
    return OK;
}

#endif
