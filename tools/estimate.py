r"""Will it fit, how fast, and with which layout? Memory and time estimate of a config on a GPU cluster.

    .venv/bin/python tools/estimate.py --config configs/llama3_8b_1m.yaml --hardware h100     # 8 GPUs (one node)
    .venv/bin/python tools/estimate.py --config configs/gpt_7b.yaml --hardware a800 --gpus 8 --set memory.mst=true
    .venv/bin/python tools/estimate.py --config configs/llama3_8b_1m.yaml --hardware h100 --auto --top 5 --write
    .venv/bin/python tools/estimate.py --config X.yaml --hardware h100 --measured memo_profile.json  # profiled
    .venv/bin/python tools/estimate.py --config configs/llama3_8b_1m.yaml --set parallel.attention_backend=fa3
    .venv/bin/python tools/estimate.py --config configs/llama3_8b_1m.yaml --auto \
        --hw-set efficiency.attention_fwd=0.5 --hw-set efficiency.attention_bwd=0.45      # attention set by hand

Prints memory by part and at each peak moment (fit / OOM / out of host memory), time by part, step time, tokens per
GPU per second and MFU with the attention backend that will run (``auto``: the fastest measured on the GPU, else
PyTorch's FA2-class kernel) and each kernel efficiency's source (published, calibrated, set by hand, or measured: GPU
and date), the Hopper-native what-if beside it, and whether MFU reaches ``--target-mfu`` (else the attention
efficiency it needs and the backends that reach it). The peak is the line marked ``<- peak``: live tensors plus the
fragmentation reserve (``tools/rehearse.py`` compares its rehearsed peak with the same figure less the reserve,
"allocated"). Under packed documents a line says how the ring's layout balances them. ``--auto`` searches tp x cp x
ulysses x memory features x chunk sizes and prints the best layouts that fit, ranked with the backend that runs;
``--write`` puts the best one into the config's parallel/memory sections (in place, or ``--write OUT.yaml``). A few
seconds (``--auto``: about a minute). Exit status: 0 fits, 1 does not fit (or nothing fits with --auto), 2 bad input.
Model and formulas: docs/estimator.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config.cli import add_config_arguments  # noqa: E402  (after the path)
from megatron_lc.estimate.tables import hopper_what_if  # noqa: E402


def profiles() -> list[str]:
    """The hardware profiles' names: ``configs/hardware/*.yaml``."""
    return sorted(n[:-5] for n in os.listdir(os.path.join(ROOT, "configs", "hardware")) if n.endswith(".yaml"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p, "before estimating")
    p.add_argument("--hardware", default="h100", help=f"a profile of configs/hardware/ ({', '.join(profiles())}) "
                   f"or a YAML path (default h100)")
    p.add_argument("--gpus", type=int, default=None, help="number of GPUs (default: one node of the profile)")
    p.add_argument("--auto", action="store_true", help="search layouts and print the best that fit")
    p.add_argument("--top", type=int, default=5, help="layouts to print with --auto (default 5)")
    p.add_argument("--write", nargs="?", const="", default=None, metavar="OUT",
                   help="with --auto: write the best layout into the config (or into OUT)")
    p.add_argument("--measured", default=None, help="inputs measured by the Memo profiler (JSON/YAML, or its log "
                   "line 'memo offload: {...}'): layer forward time, device->host bandwidth, host memory")
    p.add_argument("--layer-time", type=float, default=None, help="measured forward seconds of one layer")
    p.add_argument("--pcie-gbps", type=float, default=None, help="measured device<->host GB/s per GPU")
    p.add_argument("--host-memory-gib", type=float, default=None, help="host memory of a node (GiB)")
    p.add_argument("--plan", default=None, help="memory plan JSON (tools/plan_memory.py): its peak is the "
                   "activation arena")
    p.add_argument("--trace", default=None, help="allocation trace JSONL: planned (or its max-live bound) as the "
                   "activation arena")
    p.add_argument("--states", default="framework", help="model-state accounting: framework (this trainer, the "
                   "default) or a what-if for comparing with other systems: megatron, zero3, bf16_optim_in_backward")
    p.add_argument("--hw-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a hardware profile value (repeatable), e.g. efficiency.attention_fwd=0.35 (every "
                   "backend's) or attention.fa3.fwd=0.7 (one backend's)")
    p.add_argument("--target-mfu", type=float, default=0.5, help="the MFU the attention kernels are judged against "
                   "(default 0.5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    return p.parse_args(argv)


def summary(est) -> dict:
    m, t, w = est.memory, est.time, hopper_what_if(est)
    return {"status": m.status, "peak_bytes": m.peak, "peak_phase": m.peak_phase, "capacity_bytes": m.capacity,
            "phases": m.phases, "parts": m.parts, "host_bytes_per_node": m.host_per_node,
            "host_capacity_bytes": m.host_capacity, "alpha": m.alpha, "time_parts": t.parts,
            "step_seconds": t.step_seconds, "tokens_per_gpu_per_s": t.tokens_per_gpu_per_s, "mfu": t.mfu,
            "attention_backend": t.attention_backend, "attention_backend_named": est.backend_named,
            "efficiencies": {k: {"value": v, "source": src} for k, (v, src) in t.efficiencies.items()},
            "hopper_what_if": None if w is None else {"attention_backend": w.time.attention_backend,
                                                      "step_seconds": w.time.step_seconds, "mfu": w.time.mfu,
                                                      "peak_bytes": w.memory.peak},
            "notes": m.notes}


def hardware_overrides(pairs: list) -> dict:
    """``["efficiency.attention_fwd=0.35"]`` -> ``{"efficiency": {"attention_fwd": 0.35}}`` (values read as YAML)."""
    from megatron_lc.config import ConfigError
    out: dict = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ConfigError(f"--hw-set {pair!r}: expected KEY=VALUE (e.g. efficiency.attention_fwd=0.35)")
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.estimate import estimate, load_hardware
    from megatron_lc.estimate.tables import activation_peak_from, estimate_table, load_measured, search_table, \
        target_line, write_layout
    from megatron_lc.estimate.layout_search import pick_best, search_layouts

    try:
        cfg = load_config(args.config, args.overrides)
        measured = load_measured(args.measured) if args.measured else {}
        for key, val in (("layer_forward_seconds", args.layer_time), ("pcie_gbps", args.pcie_gbps),
                         ("host_memory_gib", args.host_memory_gib)):
            if val is not None:
                measured[key] = val
        hw = load_hardware(args.hardware, hardware_overrides(args.hw_set))
        if measured:
            hw = hw.with_measured(measured)
        world = args.gpus or hw.gpus_per_node
        act_peak = activation_peak_from(args.plan, args.trace)
        if args.write is not None and not args.auto:
            raise ConfigError("--write needs --auto (it writes the layout the search chose)")
        if not args.auto:
            est = estimate(cfg, hw, world, activation_peak_override=act_peak, states=args.states)
            print(json.dumps(summary(est), indent=1) if args.json else
                  estimate_table(est) + "\n" + target_line(est, world, args.target_mfu))
            return 0 if est.status == "fits" else 1
        cands = search_layouts(cfg, hw, world, states=args.states)
        if not cands:
            print(f"no layout of {cfg.model.num_layers}-layer model at seq {cfg.data.seq_length:,} fits on {world} x "
                  f"{hw.name} (searched tp x cp x ulysses x recompute/Memo/MsT/FPDT)", file=sys.stderr)
            return 1
        best = pick_best(cands)
        if args.json:
            print(json.dumps({"best": best.label(), "layouts": [
                {"layout": c.label(), "overrides": c.overrides, **summary(c.est)} for c in cands[:args.top]]},
                indent=1))
        else:
            print(f"{len(cands)} layouts fit on {world} x {hw.name}; the fastest {min(args.top, len(cands))} "
                  f"(* = chosen: most headroom within 0.5% of the fastest step):")
            print(search_table(cands, args.top, best))
            print("\nchosen layout:\n" + estimate_table(best.est))
            print(target_line(best.est, world, args.target_mfu))
        if args.write is not None:
            out = args.write or args.config
            write_layout(args.config, out, best, hw.name, world)
            print(f"\nwrote parallel/memory of '{best.label()}' to {out}", file=sys.stderr)
        return 0
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
