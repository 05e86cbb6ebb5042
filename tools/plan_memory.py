"""Plan the memory of a trace: ``python tools/plan_memory.py TRACE.jsonl --out plan.json [--plot plan.png]``.

Reads a JSONL trace (format: docs/memory_planning.md), plans an address for every request (bi-level when the trace
has layer marks), validates the plan, writes it, and prints a JSON summary: peak, max-live lower bound, ratio,
status, solve seconds, and the simulated PyTorch caching allocator's reserved bytes on the same trace.

``--capacity BYTES``: is there a (flat) plan under BYTES? Prints ``"answer": "feasible" | "infeasible" |
"undecided"`` (writes the plan when feasible). Exit codes: 0 a plan was written (with --capacity: feasible),
1 infeasible (proved), 3 undecided within --time-limit, 2 a bad trace or option.

``--write-trace OUT.jsonl``: write the input as a JSONL trace and stop (no plan; --out not needed), e.g. a MiniMalloc
CSV as malloc/free events in time order, frees first at one time. The planner gives the written trace the same
answer as the CSV: it reads only the order of the events and the sizes."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lc.planning.cachesim import simulate  # noqa: E402
from megatron_lc.planning.plan import Plan  # noqa: E402
from megatron_lc.planning.planner import plan_capacity, plan_trace  # noqa: E402
from megatron_lc.planning.solver.rects import PlanError  # noqa: E402
from megatron_lc.planning.trace import Trace, TraceError  # noqa: E402


def plot_plan(trace: Trace, plan: Plan, path: str, title: Optional[str] = None) -> None:
    """Draw ``plan`` over ``trace`` into ``path`` (png/pdf/svg by extension): every tensor a rectangle in (time x
    address) space, peak and lower bound marked; layer-block transients by layer (forward blue / backward orange
    shades), other tensors grey; matplotlib's Agg backend (no display needed)."""
    # matplotlib is optional (the ``planning`` extra) and only this drawing needs it
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    matplotlib.use("Agg")

    mark = {}
    for e in trace.events:
        if e.op == "malloc":
            mark[e.id] = (e.layer, e.phase)
    layers = sorted({m[0] for m in mark.values() if m[0] is not None}) or [0]
    fwd, bwd = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    scale = 1 << 20
    rects, colors = [], []
    for r in trace.requests():
        size = plan.sizes.get(r.id, r.size)
        if not size:
            continue
        layer, phase = mark[r.id]
        rects.append(Rectangle((r.start, plan.offsets[r.id] / scale), r.end - r.start, size / scale))
        if layer is None:
            colors.append((0.6, 0.6, 0.6, 0.8))
        else:
            shade = 0.35 + 0.5 * (layers.index(layer) / max(len(layers) - 1, 1))
            colors.append((fwd if phase == "fwd" else bwd)(shade))
    fig, ax = plt.subplots(figsize=(12, 6))
    ax.add_collection(PatchCollection(rects, facecolors=colors, edgecolors=(0, 0, 0, 0.25), linewidths=0.2))
    ax.axhline(plan.peak_bytes / scale, color="red", lw=1, label=f"plan peak {plan.peak_bytes / scale:.2f} MiB")
    ax.axhline(plan.lower_bound_bytes / scale, color="green", lw=1, ls="--",
               label=f"max-live lower bound {plan.lower_bound_bytes / scale:.2f} MiB")
    ax.set_xlim(0, max(len(trace.events), 1))
    ax.set_ylim(0, max(plan.peak_bytes, 1) / scale * 1.05)
    ax.set_xlabel("time (trace event)")
    ax.set_ylabel("address (MiB)")
    ax.set_title(title or f"{len(rects)} tensors, status {plan.status}, solver {plan.solver}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("trace", help="JSONL trace, or a MiniMalloc CSV (id,lower,upper,size; name ending .csv)")
    p.add_argument("--out", help="plan JSON to write (required unless --write-trace)")
    p.add_argument("--write-trace", metavar="OUT", help="write the input as a JSONL trace and stop")
    p.add_argument("--plot", help="draw the plan (png/pdf/svg)")
    p.add_argument("--solver", default="auto", choices=["auto", "greedy", "search", "cpsat", "mip"],
                   help="auto: greedy, the exact search when greedy is above the bound, CP-SAT (when OR-Tools is "
                        "installed: the planning extra) when the search has not proved its plan optimal")
    p.add_argument("--capacity", type=int, help="bytes: find any plan under it, or say it is infeasible or undecided "
                   "(exit 0 / 1 / 3)")
    p.add_argument("--time-limit", type=float, default=10.0, help="seconds for the whole plan (default 10)")
    p.add_argument("--mode", default="auto", choices=["auto", "bilevel", "flat"])
    p.add_argument("--pseudo", default="skyline", choices=["skyline", "rectangle"],
                   help="how a layer block enters the second level (rectangle: the paper's pseudo request)")
    p.add_argument("--alignment", type=int, default=512, help="bytes; sizes and offsets are multiples")
    p.add_argument("--gap", type=float, default=0.0,
                   help="relative gap to the lower bound at which no solver time is spent (default 0: try to prove)")
    args = p.parse_args(argv)
    if not args.out and not args.write_trace:
        p.error("the following arguments are required: --out (or --write-trace)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("error: --plot needs matplotlib, which is not installed (pip install 'megatron_lc[plot]')",
              file=sys.stderr)
        return 2

    try:
        trace = Trace.load_csv(args.trace) if args.trace.endswith(".csv") else Trace.load(args.trace)
        if args.write_trace:
            trace.dump(args.write_trace)
            print(json.dumps({"trace": args.trace, "written": args.write_trace, **trace.stats()}, indent=1))
            return 0
        if args.capacity is not None:
            answer, plan = plan_capacity(trace, args.capacity, time_limit=args.time_limit, alignment=args.alignment)
            if plan is None:
                print(json.dumps({"trace": args.trace, "capacity_bytes": args.capacity, "answer": answer}, indent=1))
                return 1 if answer == "infeasible" else 3
        else:
            plan = plan_trace(trace, mode=args.mode, solver=args.solver, time_limit=args.time_limit,
                              alignment=args.alignment, pseudo=args.pseudo, gap=args.gap)
        plan.write(args.out, trace)
    except (OSError, TraceError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sim = simulate(trace)
    summary = {"trace": args.trace, "requests": len(plan.offsets), "peak_bytes": plan.peak_bytes,
               "lower_bound_bytes": plan.lower_bound_bytes,
               "peak_over_lower_bound": plan.peak_bytes / max(plan.lower_bound_bytes, 1),
               "status": plan.status, "solver": plan.solver, "solve_seconds": round(plan.solve_seconds, 3),
               "cachesim_reserved_bytes": sim.peak_reserved_bytes,
               "cachesim_reserved_over_plan_peak": sim.peak_reserved_bytes / max(plan.peak_bytes, 1),
               "out": args.out}
    if args.capacity is not None:
        summary.update(capacity_bytes=args.capacity, answer="feasible")
    if args.plot:
        plot_plan(trace, plan, args.plot)
        summary["plot"] = args.plot
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
