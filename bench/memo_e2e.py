"""Memo Figure 12(d)'s check on the demo model: ``configs/tiny_cpu.yaml`` (stdlib-sources corpus, 4 layers, 256 hidden,
seq 256, global batch 16) trained 10 steps without offload and with Memo at alpha = 0, 0.5, 1 (and auto), same
seed; prints every run's per-step losses, the largest relative difference to the run without offload, and the
step-time ratios.

    python bench/memo_e2e.py                  # single process: the global batch of 16 as 4 micro-batches of 4
    python bench/memo_e2e.py --steps 3 --rows none,a0.5

The config's dp=2 (torchrun, 2 ranks) and one process with 4 micro-batches see the same global batch, so the loss
curves are the same; one process keeps this a single command. The demo corpus is built on first use (rank 0).
Output: one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

ROWS = {"none": [], "a0": ["memory.activation_offload=memo", "memory.offload_fraction=0"],
        "a0.5": ["memory.activation_offload=memo", "memory.offload_fraction=0.5"],
        "a1": ["memory.activation_offload=memo", "memory.offload_fraction=1"],
        "auto": ["memory.activation_offload=memo", "memory.offload_fraction=auto"]}


def run(overrides: list, steps: int) -> dict:
    import torch

    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.entry import prepare_data
    from megatron_lc.training.loop import Trainer

    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"),
                      [f"train.train_iters={steps}", "checkpoint.save=null", "logging.log_interval=1000",
                       f"data.data_path={os.path.join(ROOT, 'data/stdlib_py')}",
                       f"data.tokenizer_model={os.path.join(ROOT, 'data/stdlib_py_sp8k.model')}"] + overrides)
    prepare_data(cfg, 0)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, Topology(), torch.device("cpu"))
    state = trainer.train()
    rt = trainer.ctx.memo
    return {"losses": state.losses, "seconds": time.perf_counter() - t0,
            "alpha": None if rt is None else rt.alpha,
            "host_bytes": 0 if rt is None else rt.host_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", default="none,a0,a0.5,a1")
    args = ap.parse_args()
    out = {name: run(ROWS[name], args.steps) for name in args.rows.split(",")}
    ref = out.get("none")
    for r in out.values():
        if ref is not None:
            r["max_rel_diff_vs_none"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"]))
            r["time_vs_none"] = r["seconds"] / ref["seconds"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
