"""The longest sequence the estimator finds a layout for, Llama3-8B on 1, 8 and 32 H100-80GB (one node = 8 GPUs with
the h100 profile's host memory), with and without the model-state and offload options of issue 17.

    python bench/longest_sequence.py            # JSON on stdout (~3-6 minutes on 2 cores)
    python bench/longest_sequence.py --quick    # 1 and 8 GPUs, coarse

For each GPU count and option set: doubling from 128K tokens while ``estimate.layout_search.search_layouts`` finds a
layout that fits device and host memory, then bisection to 128K tokens (sequence lengths stay multiples of 128K so
every layout's divisibility rules can hold). Option sets (filters on the searched layouts):

* ``zero1``: what the framework had before FSDP2 -- replicated fp32 parameters and gradients, ZeRO-1 AdamW, Memo /
  recompute / MsT / FPDT, no host checkpoints;
* ``fsdp2``: + FSDP2 (with and without CPU offload);
* ``all``: + ``activation_offload: checkpoints`` (with or without ``memory.layer_chunk_size``);
* ``all+bf16_residual``: the same with ``model.fp32_residual_connection: false`` -- the residual stream (so every
  layer input and host checkpoint) in bf16, as Megatron-LM's default, ALST and FPDT keep it; the framework's default
  keeps it fp32, so this row is a numerics choice the user makes, not one the search makes.

Each row: the longest length, its layout label, predicted MFU and step seconds. These are estimates (the memory model
is calibrated on CPU runs; the GPU side -- bandwidths, kernel efficiencies, allocator -- is the h100 profile's
assumption, unmeasured here).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEP = 131072
OPTIONS = {  # name -> (filter on a searched layout's overrides, config overrides)
    "zero1": (lambda o: not o.get("parallel.use_torch_fsdp2") and o["memory.activation_offload"] != "checkpoints",
              {}),
    "fsdp2": (lambda o: o["memory.activation_offload"] != "checkpoints", {}),
    "all": (lambda o: True, {}),
    "all+bf16_residual": (lambda o: True, {"model.fp32_residual_connection": False}),
}


def best_at(cfg, hw, gpus: int, seq: int, keep):
    from megatron_lc.estimate.layout_search import apply_overrides, search_layouts

    fits = [c for c in search_layouts(apply_overrides(cfg, {"data.seq_length": seq}), hw, gpus) if keep(c.overrides)]
    return fits[0] if fits else None


def longest(cfg, hw, gpus: int, keep, coarse: bool) -> dict:
    lo, hi, best = 0, None, None
    seq = STEP
    while hi is None:  # doubling
        c = best_at(cfg, hw, gpus, seq, keep)
        if c is None:
            hi = seq
        else:
            lo, best, seq = seq, c, seq * 2
    while not coarse and hi - lo > STEP:  # bisection in multiples of STEP
        mid = (lo + hi) // 2 // STEP * STEP
        c = best_at(cfg, hw, gpus, mid, keep)
        if c is None:
            hi = mid
        else:
            lo, best = mid, c
    if best is None:
        return {"longest_tokens": 0}
    return {"longest_tokens": lo, "layout": best.label(), "mfu": round(best.est.time.mfu, 4),
            "step_seconds": round(best.step_seconds, 1), "peak_gib": round(best.est.memory.peak / 2 ** 30, 1),
            "host_gib_per_node": round(best.est.memory.host_per_node / 2 ** 30, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    from megatron_lc.config import load_config
    from megatron_lc.estimate.hardware import load_hardware

    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b_1m.yaml"), [])
    hw = load_hardware("h100")
    out = {"model": "Llama3-8B (configs/llama3_8b_1m.yaml)", "hardware": "h100 profile", "step_tokens": STEP,
           "rows": []}
    for gpus in ((1, 8) if args.quick else (1, 8, 32)):
        for name, (keep, sets) in OPTIONS.items():
            from megatron_lc.estimate.layout_search import apply_overrides

            row = {"gpus": gpus, "options": name, **longest(apply_overrides(cfg, sets), hw, gpus, keep, args.quick)}
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
