"""Memory planning (the Memo paper's bi-level plan and the static allocator that replays it).

    trace.py, plan.py    the two formats: a malloc/free trace in, a plan (an offset per request) out
    capture/             a micro-batch's trace: the live-bytes tracker (tracker.py) and the recording (record.py)
    solver/              one instance of the allocation problem solved: greedy, the exact placement search (its C
                         twin in solver/csrc/), CP-SAT, the paper's MIP
    planner.py           a trace -> a plan: flat, or bi-level (bilevel.py: each layer block once, then the iteration)
    cachesim.py          the same trace under PyTorch's caching-allocator policy (the baseline a plan is set beside)
    memory_plan.py       ``memory.plan`` at setup: the technique runtime that plans a step and installs the arena
    replay_cuda.py       a whole plan replayed through ``CUDAPluggableAllocator`` (csrc/plan_alloc.c; GPU only)

Modules are imported by path (``planning.planner``, ...): OR-Tools loads only where it runs. The planner's
benchmarks (``bench/planner.py``, ``bench/synth_traces.py``) and the plot of a plan (``tools/plan_memory.py``) live
beside the benchmark and the tool that use them."""
