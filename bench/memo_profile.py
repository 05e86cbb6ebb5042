"""Memo's profiler on this machine: the inputs of the alpha LP (skeletal sizes of one layer, layer forward time,
device<->host bandwidth, host memory per rank) and the alpha it gives, for a config.

    python bench/memo_profile.py                                   # configs/tiny_cpu.yaml, 1 process
    python bench/memo_profile.py --set data.seq_length=4096 --set memory.host_memory_gb=0.05

Output: one JSON object on stdout (the same numbers the training log line ``memo offload: {...}`` carries).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:

    from megatron_lc.config import load_config
    from tests.support.parity import build

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs/tiny_cpu.yaml"))
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(args.config, ["memory.activation_offload=memo", "memory.offload_fraction=auto",
                                    "data.mock_data=true"] + args.set)
    _, ctx = build(cfg)  # the calibration profiles, solves alpha and allocates the rounding buffers
    rt = ctx.memo
    print(json.dumps({"config": args.config, "overrides": args.set, "alpha": rt.alpha,
                      "solver": rt.alpha_result.as_dict(), "profile": rt.profile.as_dict(),
                      "rounding_buffer_bytes": rt.buffers[0].capacity}, indent=1))


if __name__ == "__main__":
    main()
