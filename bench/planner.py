"""Memory planner benchmark: plan peak / max-live lower bound, solve seconds, and the simulated PyTorch caching
allocator's reserved bytes / plan peak, on the same traces, side by side for the solver variants.

    python bench/planner.py            # JSON on stdout (~2-4 minutes on 2 cores)
    python bench/planner.py --quick    # smaller traces, for a smoke run

Traces:
- ``tiny-L{n}[-recompute]``: captured from the tiny Llama (tests' small_config: hidden 64, 8 heads, 4 kv heads,
  seq 32, micro-batch 2) with the dispatch-level tracer, one micro-batch forward + backward; recompute = torch
  checkpoint around each layer.
- ``tiny_cpu.yaml``: the demo model (hidden 256, 4 layers, vocab 8000, seq 256, micro-batch 4), captured the same way.
- ``llama3-8b-layer``: one Llama3-8B layer's forward + backward generated from shapes (seq 32768, bf16).
- ``llama3-8b-iter-*``: 32 layers + LM head generated from shapes: full recompute + MsT (MLP in 16
  mini-sequences, head in 32) at seq 65536 -- 12,033 requests -- and no recompute at seq 32768.

Variants: ``flat-greedy`` (largest-first, best of 4 orders), ``flat-cpsat`` (greedy + CP-SAT, time limit),
``bilevel-rectangle`` (the paper: a layer block is one pseudo request of its first-level peak), ``bilevel-skyline``
(ours: a block is the rigid shape of its first-level top over time, first level aware of the tensors outside the
block), ``mip`` (the paper's big-M MIP on HiGHS via scipy, on the small traces only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def tiny_trace(layers: int, recompute: bool, config: str = ""):

    from megatron_lc.config import load_config
    from megatron_lc.memory.recompute import with_layer_checkpoint
    from megatron_lc.planning.capture import capture_iteration
    from tests.parity import batch_for, build, small_config

    if config:  # the demo model (configs/tiny_cpu.yaml), one micro-batch of random tokens
        cfg = load_config(config, ["data.mock_data=true", "train.device=cpu"])
    else:
        cfg = small_config([f"model.num_layers={layers}"])
    model, ctx = build(cfg, adjust_spec=with_layer_checkpoint if recompute else None)
    return capture_iteration(model, batch_for(cfg, batch=cfg.train.micro_batch_size), ctx.arena)


def run_variant(trace, name: str, time_limit: float) -> dict:
    from megatron_lc.planning.planner import plan_trace

    mode, _, rest = name.partition("-")
    kw = {"flat": dict(mode="flat", solver=rest), "bilevel": dict(mode="bilevel", pseudo=rest, solver="cpsat"),
          "mip": dict(mode="flat", solver="mip")}[mode]
    t0 = time.perf_counter()
    plan = plan_trace(trace, time_limit=time_limit, **kw)
    secs = time.perf_counter() - t0
    return {"peak_bytes": plan.peak_bytes, "peak_over_lower_bound": round(plan.peak_bytes / plan.lower_bound_bytes, 5),
            "status": plan.status, "solver": plan.solver, "solve_seconds": round(secs, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--time-limit", type=float, default=10.0)
    args = p.parse_args(argv)

    from megatron_lc.planning.cachesim import simulate
    from megatron_lc.planning.synth import LlamaShape, llama_iteration_trace, llama_layer_trace

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
        variants = ["flat-greedy", "flat-cpsat", "bilevel-rectangle", "bilevel-skyline"]
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
