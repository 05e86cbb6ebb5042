"""One instance of the offline storage-allocation problem (rectangles of time x bytes) placed at addresses.

    dsa.py               solve_dsa: greedy warm start; the exact search when greedy is above the max-live bound;
                         CP-SAT (OR-Tools) or the paper's MIP where asked; the result validated
    rects.py             the instance (Rects), greedy orders, CP-SAT, validation (PlanError)
    placement_search.py  the exact search over canonical placements (after MiniMalloc): sections.py (the instance
                         prepared), blame.py (backjumping), capacity.py (peak minimised over "fits under C?")
    native.py            the search's node-for-node C twin (csrc/dsa_search.c, dsa_search.h, dsa_blame.h), built on
                         first use; Python is the fallback
    mip.py               the paper's big-M MIP through scipy's HiGHS

Modules are imported by path."""
