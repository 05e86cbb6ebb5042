/* Plan-replay allocator for torch.cuda.memory.CUDAPluggableAllocator (megatron_lc/memory/arena_cuda.py).
 *
 * One arena of the plan's peak size. Inside a planned iteration (plan_begin_iteration()), the k-th malloc gets
 * arena + offset[k] when its size (rounded to 512) equals the planned size[k] and no live planned block overlaps
 * that range; any other request -- outside an iteration, after the plan's last request, or after a divergence --
 * goes to the backend allocator (cudaMalloc; host malloc when built with -DPLAN_ALLOC_HOST, the CPU twin the
 * tests drive through ctypes) and is counted. Frees inside the arena only mark the block dead.
 * Single-threaded by assumption (the caller's allocator lock); no stream semantics beyond the default stream.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/types.h>

#ifdef PLAN_ALLOC_HOST
static void *backend_malloc(size_t n) { return malloc(n ? n : 1); }
static void backend_free(void *p) { free(p); }
#else
extern int cudaMalloc(void **p, size_t n);
extern int cudaFree(void *p);
static void *backend_malloc(size_t n) { void *p = NULL; return cudaMalloc(&p, n) == 0 ? p : NULL; }
static void backend_free(void *p) { cudaFree(p); }
#endif

static char *arena = NULL;
static size_t arena_bytes = 0;
static long long *sizes = NULL, *offsets = NULL;
static int n_plan = 0, cursor = 0, active = 0, diverged = 0, owns_arena = 0;
static int *live = NULL; /* indices of live planned blocks */
static int n_live = 0;
static long long hits = 0, fallbacks = 0, outside = 0;

static long long round512(long long n) { return n <= 0 ? 512 : (n + 511) / 512 * 512; }

/* Load a plan: n requests in malloc order with aligned sizes and offsets; base == NULL allocates the arena. */
int plan_load(long long bytes, int n, const long long *sz, const long long *off, void *base) {
    free(sizes); free(offsets); free(live);
    sizes = malloc(sizeof(long long) * (n ? n : 1));
    offsets = malloc(sizeof(long long) * (n ? n : 1));
    live = malloc(sizeof(int) * (n ? n : 1));
    if (!sizes || !offsets || !live) return -1;
    for (int i = 0; i < n; i++) { sizes[i] = sz[i]; offsets[i] = off[i]; }
    n_plan = n; cursor = 0; active = 0; diverged = 0; n_live = 0; hits = fallbacks = outside = 0;
    if (base) { arena = base; owns_arena = 0; }
    else { arena = backend_malloc((size_t)bytes); owns_arena = 1; if (!arena) return -2; }
    arena_bytes = (size_t)bytes;
    return 0;
}

void plan_begin_iteration(void) { cursor = 0; active = 1; diverged = 0; }
void plan_end_iteration(void) { active = 0; }
void *plan_arena_base(void) { return arena; }

/* counters: hits (served from the plan), fallbacks (diverged inside an iteration), outside (no iteration) */
void plan_stats(long long *out) { out[0] = hits; out[1] = fallbacks; out[2] = outside; out[3] = n_live; }

static int overlaps_live(long long lo, long long hi) {
    for (int j = 0; j < n_live; j++) {
        long long o = offsets[live[j]], e = o + sizes[live[j]];
        if (o < hi && lo < e) return 1;
    }
    return 0;
}

void *plan_malloc(ssize_t size, int device, void *stream) {
    (void)device; (void)stream;
    if (active && !diverged && cursor < n_plan) {
        int k = cursor;
        if (round512(size) == sizes[k] && !overlaps_live(offsets[k], offsets[k] + sizes[k])) {
            cursor++;
            live[n_live++] = k;
            hits++;
            return arena + offsets[k];
        }
        diverged = 1; /* the rest of this iteration uses the backend */
    }
    if (active && diverged) fallbacks++; else outside++; /* outside: no iteration, or past the plan's end */
    return backend_malloc((size_t)size);
}

void plan_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    char *p = (char *)ptr;
    if (arena && p >= arena && p < arena + arena_bytes) {
        long long off = p - arena;
        for (int j = 0; j < n_live; j++)
            if (offsets[live[j]] == off) { live[j] = live[--n_live]; return; }
        return;
    }
    backend_free(ptr);
}
