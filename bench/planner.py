"""Memory planner benchmark: plan peak / max-live lower bound, solve seconds, and the simulated PyTorch caching
allocator's reserved bytes / plan peak, on the same traces, side by side for the solver variants.

    python bench/planner.py            # JSON on stdout (~2-4 minutes on 2 cores)
    python bench/planner.py --quick    # smaller traces, for a smoke run
    python bench/planner.py --challenging [--time-limit 10]   # MiniMalloc's hard set, CSV and trace (~6 minutes)

Traces:
- ``tiny-L{n}[-recompute]``: captured from the tiny Llama (tests' small_config: hidden 64, 8 heads, 4 kv heads,
  seq 32, micro-batch 2) with the dispatch-level tracer, one micro-batch forward + backward; recompute = torch
  checkpoint around each layer.
- ``tiny_cpu.yaml``: the demo model (hidden 256, 4 layers, vocab 8000, seq 256, micro-batch 4), captured the same way.
- ``llama3-8b-layer``: one Llama3-8B layer's forward + backward generated from shapes (seq 32768, bf16).
- ``llama3-8b-iter-*``: 32 layers + LM head generated from shapes: full recompute + MsT (MLP in 16
  mini-sequences, head in 32) at seq 65536 -- 12,033 requests -- and no recompute at seq 32768.

Variants: ``flat-greedy`` (largest-first, best of 4 orders), ``flat-search`` (greedy + the exact search),
``flat-cpsat`` (greedy + CP-SAT, time limit; only with OR-Tools), the bi-level plans with solver ``auto`` (greedy,
the exact search, CP-SAT when installed): ``bilevel-rectangle`` (the paper: a layer block is one pseudo request of
its first-level peak), ``bilevel-skyline``
(ours: a block is the rigid shape of its first-level top over time, first level aware of the tensors outside the
block), ``mip`` (the paper's big-M MIP on HiGHS via scipy, on the small traces only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tiny_trace(layers: int, recompute: bool, config: str = ""):

    from megatron_lc.config import load_config
    from megatron_lc.memory.recompute import with_layer_checkpoint
    from megatron_lc.planning.capture.record import capture_iteration
    from tests.support.parity import batch_for, build, small_config

    if config:  # the demo model (configs/tiny_cpu.yaml), one micro-batch of random tokens
        cfg = load_config(config, ["data.mock_data=true", "train.device=cpu"])
    else:
        cfg = small_config([f"model.num_layers={layers}"])
    model, ctx = build(cfg, adjust_spec=with_layer_checkpoint if recompute else None)
    return capture_iteration(model, batch_for(cfg, batch=cfg.train.micro_batch_size), ctx.arena)


def run_variant(trace, name: str, time_limit: float) -> dict:
    from megatron_lc.planning.planner import plan_trace

    mode, _, rest = name.partition("-")
    kw = {"flat": dict(mode="flat", solver=rest), "bilevel": dict(mode="bilevel", pseudo=rest, solver="auto"),
          "mip": dict(mode="flat", solver="mip")}[mode]
    t0 = time.perf_counter()
    plan = plan_trace(trace, time_limit=time_limit, **kw)
    secs = time.perf_counter() - t0
    return {"peak_bytes": plan.peak_bytes, "peak_over_lower_bound": round(plan.peak_bytes / plan.lower_bound_bytes, 5),
            "status": plan.status, "solver": plan.solver, "solve_seconds": round(secs, 2)}


CHALLENGING = os.path.join(ROOT, "bench", "data", "minimalloc_challenging")
MINIMALLOC_CAPACITY = 1048576  # MiniMalloc solves each instance at this capacity (the files' names, its scripts)
ENCODINGS = ("csv", "trace")  # MiniMalloc's times as published; the trace written from the CSV (event positions)


def challenging(time_limit: float, tmp: str) -> list:
    """Per instance of MiniMalloc's challenging set, side by side for its two encodings -- the CSV with its times
    as published, and the trace written from it (``plan_memory.py X.csv --write-trace``: malloc/free events, event
    positions as times): the max-live bound, greedy's peak, the capacity mode at MiniMalloc's capacity (answer,
    seconds, search nodes, plan validated) on the planner's instance (``planner.flat_instance``: times counted in
    runs of mallocs and frees) on the C core and on the Python search (the C core only when it builds), the same
    search on the encoding's own times (C core), the peak-minimising mode started from the capacity mode's plan
    (``solve_dsa`` with ``auto``: greedy, search, CP-SAT if installed), and what ``plan_memory.py X --alignment 1``
    ends with (``plan_flat``, no start)."""
    import numpy as np

    from megatron_lc.planning.solver import native
    from megatron_lc.planning.solver.dsa import solve_dsa
    from megatron_lc.planning.planner import flat_instance, plan_flat
    from megatron_lc.planning.solver.placement_search import fit
    from megatron_lc.planning.solver.rects import PlanError, Rects, best_greedy, validate
    from megatron_lc.planning.trace import Trace

    rows, cap = [], MINIMALLOC_CAPACITY
    for name in sorted(os.listdir(CHALLENGING)):
        if not name.endswith(".csv"):
            continue
        written = os.path.join(tmp, name[:-4] + ".jsonl")
        Trace.load_csv(os.path.join(CHALLENGING, name)).dump(written)
        traces = {"csv": Trace.load_csv(os.path.join(CHALLENGING, name)), "trace": Trace.load(written)}
        row = {"instance": name.split(".")[0], "buffers": len(traces["csv"].requests())}
        for enc in ENCODINGS:
            trace = traces[enc]
            reqs = trace.requests()
            own = Rects.flat(*(np.array([getattr(r, k) for r in reqs]) for k in ("size", "start", "end")))
            inst = flat_instance(trace, 1)[2]  # what the planner searches: times in runs of mallocs and frees

            def capacity_mode(backend: str, inst=inst) -> tuple:
                t0 = time.perf_counter()
                r = fit(inst, cap, time_limit=time_limit, backend=backend)
                secs = time.perf_counter() - t0
                valid = None
                if r.offsets is not None:
                    try:
                        validate(list(range(inst.n)), inst.height, inst.start, inst.end, r.offsets, cap)
                        valid = True
                    except PlanError:
                        valid = False
                return r, {"answer": r.status, "seconds": round(secs, 3), "nodes": r.nodes, "validated": valid,
                           "backend": backend, "load_average_1min": round(os.getloadavg()[0], 1)}

            modes = {}
            if native.load() is not None:
                r, modes["capacity_mode"] = capacity_mode("native")
                modes["capacity_mode_python"] = capacity_mode("python")[1]
                modes["capacity_mode_own_times"] = capacity_mode("native", own)[1]
            else:
                r, modes["capacity_mode"] = capacity_mode("python")
            valid = modes["capacity_mode"]["validated"]
            t0 = time.perf_counter()
            # the minimiser starts from the capacity mode's plan when there is one: never above a capacity found
            start = (r.offsets, inst.peak(r.offsets)) if valid else None
            sol = solve_dsa(inst, solver="auto", time_limit=time_limit, start=start)  # validates its plan or raises
            modes["minimise_mode"] = {"peak_bytes": sol.peak,
                                      "peak_over_lower_bound": round(sol.peak / sol.lower_bound, 4),
                                      "status": sol.status, "solver": sol.solver,
                                      "seconds": round(time.perf_counter() - t0, 2), "validated": True}
            t0 = time.perf_counter()
            plan = plan_flat(trace, solver="auto", time_limit=time_limit, alignment=1)  # plan_memory.py's flat plan
            plan.validate(trace)
            modes["plan_memory"] = {"peak_bytes": plan.peak_bytes, "at_or_under_capacity": plan.peak_bytes <= cap,
                                    "status": plan.status, "solver": plan.solver,
                                    "seconds": round(time.perf_counter() - t0, 2)}
            row[enc] = {"lower_bound_bytes": inst.lower_bound(), "greedy_peak_bytes": best_greedy(inst)[1],
                        "greedy_peak_bytes_own_times": best_greedy(own)[1], **modes}
        row["minimalloc_published"] = {"capacity_bytes": cap, "solved": True, "seconds": "not published per instance"}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--time-limit", type=float, default=10.0)
    p.add_argument("--challenging", action="store_true", help="MiniMalloc's challenging set instead of our traces")
    args = p.parse_args(argv)
    if args.challenging:
        with tempfile.TemporaryDirectory() as tmp:
            rows = challenging(args.time_limit, tmp)
        print(json.dumps({"bench": "planner-challenging", "time_limit": args.time_limit, "cpus": os.cpu_count(),
                          "load_average_1min": round(os.getloadavg()[0], 1), "rows": rows}, indent=1))
        return 0

    from megatron_lc.planning.cachesim import simulate
    from megatron_lc.planning.solver.dsa import have_ortools
    from bench.synth_traces import LlamaShape, llama_iteration_trace, llama_layer_trace

    tl = args.time_limit
    traces = [("tiny-L1", lambda: tiny_trace(1, False)), ("tiny-L4", lambda: tiny_trace(4, False)),
              ("tiny-L4-recompute", lambda: tiny_trace(4, True)),
              ("tiny_cpu.yaml", lambda: tiny_trace(4, False, os.path.join(ROOT, "configs", "tiny_cpu.yaml"))),
              ("llama3-8b-layer", lambda: llama_layer_trace(LlamaShape.llama3_8b(32768)))]
    if args.quick:
        traces.append(("llama3-8b-iter-recompute-mst-s16k-L8", lambda: llama_iteration_trace(
            LlamaShape.llama3_8b(16384), 8, mlp_chunks=4, head_chunks=32, recompute=True)))
    else:
        traces += [("llama3-8b-iter-recompute-mst-s64k", lambda: llama_iteration_trace(
                       LlamaShape.llama3_8b(65536), 32, mlp_chunks=16, head_chunks=32, recompute=True)),
                   ("llama3-8b-iter-s32k", lambda: llama_iteration_trace(
                       LlamaShape.llama3_8b(32768), 32, mlp_chunks=1, head_chunks=8, recompute=False))]
    rows = []
    for name, make in traces:
        tr = make()
        st = tr.stats()
        row = {"trace": name, "requests": st["requests"], "layer_blocks": st["blocks"],
               "lower_bound_bytes": None, "variants": {}}
        big = st["requests"] > 2000
        variants = ["flat-greedy", "flat-search"] + (["flat-cpsat"] if have_ortools() else []) + [
            "bilevel-rectangle", "bilevel-skyline"]
        if st["requests"] <= 200:
            variants.append("mip")
        for v in variants:
            if big and v == "flat-cpsat":
                continue  # CP-SAT on >2,000 flat boxes only spends its time limit building the model
            row["variants"][v] = run_variant(tr, v, tl)
        from megatron_lc.planning.planner import plan_trace

        row["lower_bound_bytes"] = plan_trace(tr, mode="flat", solver="greedy").lower_bound_bytes
        best = min(r["peak_bytes"] for r in row["variants"].values())
        sim = simulate(tr)
        row["cachesim"] = {"reserved_bytes": sim.peak_reserved_bytes, "allocated_bytes": sim.peak_allocated_bytes,
                           "segments": sim.segments_allocated,
                           "reserved_over_best_plan_peak": round(sim.peak_reserved_bytes / best, 4),
                           "reserved_over_lower_bound": round(sim.peak_reserved_bytes / row["lower_bound_bytes"], 4)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    print(json.dumps({"bench": "planner", "time_limit": tl, "cpus": os.cpu_count(),
                      "load_average_1min": round(os.getloadavg()[0], 1), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
