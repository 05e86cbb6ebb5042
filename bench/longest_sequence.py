"""The longest sequence the estimator finds a layout for, Llama3-8B on 1, 8, 16 and 32 H100-80GB (one node = 8 GPUs
with the h100 profile's host memory), per option set, beside Arctic Long Sequence Training's published lengths, and
the step time the chosen layout predicts there (what a user pays for the length).

    python bench/longest_sequence.py            # JSON on stdout (~30-60 minutes on 2 shared cores)
    python bench/longest_sequence.py --quick    # 1 and 8 GPUs, coarse
    python bench/longest_sequence.py --gpus 8,16,32 --residual bf16   # some GPU counts, one residual stream

For each GPU count, residual dtype and option set: doubling from 128K tokens while
``estimate.layout_search.search_layouts`` finds a layout that fits device and host memory, then bisection to 128K
tokens (sequence lengths stay multiples of 128K so every layout's divisibility rules can hold). One search per
(GPU count, residual dtype, length) serves every option set: each keeps the fastest fitting layout its filter
allows. Option sets:

* ``zero1``: replicated fp32 parameters and gradients, ZeRO-1 AdamW, Memo / recompute / MsT / FPDT, no host
  checkpoints;
* ``fsdp2``: + FSDP2 (with and without CPU offload);
* ``ckpt``: + ``activation_offload: checkpoints`` with every layer's input on the host (with or without
  ``memory.layer_chunk_size``) around a core attention -- what the search tried before segments;
* ``all``: + segments (``memory.checkpoint_every`` k) and FPDT with the host checkpoints, its block as the chunked
  layer's attention or not;

each with the framework's default fp32 residual stream and with ``model.fp32_residual_connection: false`` (``+bf16``:
the residual stream, so every layer input and host checkpoint, in bf16, as Megatron-LM's default, ALST and FPDT keep
it -- a numerics choice the user makes, not one the search makes).

Each row: the longest length, its layout label, predicted MFU, step seconds, device peak and host per node. These are
estimates (the memory model is calibrated on CPU runs and on full-scale rehearsals; the GPU side -- bandwidths,
kernel efficiencies, allocator -- is the h100 profile's assumption, unmeasured here); ALST's are its measurements.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_lc.config import load_config  # noqa: E402  (after the path)
from megatron_lc.estimate.hardware import load_hardware  # noqa: E402
from megatron_lc.estimate.layout_search import apply_overrides, search_layouts  # noqa: E402

STEP = 131072
# Arctic Long Sequence Training's published Llama-3.1-8B lengths on H100s (its measurements, its hardware)
ALST = {1: 500_000, 8: 3_800_000, 16: 8_000_000, 32: 15_500_000}


def _ckpt_every_layer(o: dict) -> bool:
    """What the search tried before segments: the host checkpoints with every layer's input, around a core attention
    (FPDT's block was searched without them)."""
    ckpt = o["memory.activation_offload"] == "checkpoints"
    return not (ckpt and (o.get("memory.checkpoint_every", 1) > 1 or o["parallel.cp_comm_type"] == "fpdt"))


OPTIONS = {  # name -> filter on a searched layout's overrides
    "zero1": lambda o: not o.get("parallel.use_torch_fsdp2") and o["memory.activation_offload"] != "checkpoints",
    "fsdp2": lambda o: o["memory.activation_offload"] != "checkpoints",
    "ckpt": _ckpt_every_layer,
    "all": lambda o: True,
}
RESIDUALS = {"": {}, "+bf16": {"model.fp32_residual_connection": False}}


class Searches:
    """``search_layouts`` once per length for one config and GPU count; the fitting layouts, fastest first."""

    def __init__(self, cfg, hw, gpus: int):
        self.cfg, self.hw, self.gpus, self.cache = cfg, hw, gpus, {}

    def best(self, seq: int, keep):
        if seq not in self.cache:
            self.cache[seq] = search_layouts(apply_overrides(self.cfg, {"data.seq_length": seq}), self.hw, self.gpus)
        return next((c for c in self.cache[seq] if keep(c.overrides)), None)


def longest(searches: Searches, keep, coarse: bool) -> dict:
    lo, hi, best = 0, None, None
    seq = STEP
    while hi is None:  # doubling
        c = searches.best(seq, keep)
        if c is None:
            hi = seq
        else:
            lo, best, seq = seq, c, seq * 2
    while not coarse and hi - lo > STEP:  # bisection in multiples of STEP
        mid = (lo + hi) // 2 // STEP * STEP
        c = searches.best(mid, keep)
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
    p.add_argument("--gpus", default="1,8,16,32", help="GPU counts, comma-separated (default: 1,8,16,32)")
    p.add_argument("--residual", choices=("both", "fp32", "bf16"), default="both",
                   help="residual streams searched (default: both)")
    args = p.parse_args(argv)
    gpu_counts = [g.strip() for g in args.gpus.split(",")]
    if any(g not in map(str, ALST) for g in gpu_counts):  # one line, no usage block
        print(f"error: --gpus {args.gpus}: each must be one of {', '.join(map(str, ALST))}", file=sys.stderr)
        return 2
    gpu_counts = [int(g) for g in gpu_counts]
    residuals = {k: v for k, v in RESIDUALS.items() if args.residual in ("both", "bf16" if k else "fp32")}
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b_1m.yaml"), [])
    hw = load_hardware("h100")
    out = {"model": "Llama3-8B (configs/llama3_8b_1m.yaml)", "hardware": "h100 profile", "step_tokens": STEP,
           "alst_published": {str(g): n for g, n in ALST.items()}, "rows": []}
    for gpus in ((1, 8) if args.quick else gpu_counts):
        for suffix, sets in residuals.items():
            searches = Searches(apply_overrides(cfg, sets), hw, gpus)
            for name, keep in OPTIONS.items():
                row = {"gpus": gpus, "options": name + suffix, **longest(searches, keep, args.quick),
                       "alst_tokens": ALST[gpus]}
                out["rows"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
