"""Issues 3 and 4's end-to-end check: the demo model (``configs/tiny_cpu.yaml``: stdlib-sources corpus, seq 256, global
batch 16) trained N steps with each context-parallel demo config, against cp = 1, through the real launcher:

    torchrun --nproc-per-node 2 pretrain_gpt.py --config configs/tiny_cpu.yaml          (dp 2, cp 1: the reference)
    torchrun --nproc-per-node 2 pretrain_gpt.py --config configs/tiny_cpu_cp_ring.yaml  (ring cp 2)
    torchrun --nproc-per-node 2 pretrain_gpt.py --config configs/tiny_cpu_cp_ulysses.yaml
    torchrun --nproc-per-node 4 pretrain_gpt.py --config configs/tiny_cpu_cp_hybrid.yaml (Ulysses 2 x ring 2)
    torchrun --nproc-per-node 2 pretrain_gpt.py --config configs/tiny_cpu_fpdt.yaml      (FPDT P 2, u 4, offload)

    python bench/cp_e2e.py                 # 5 steps each (~3 minutes on 2 shared cores)
    python bench/cp_e2e.py --steps 2

Same model, data, seed and global batch in every run, so the losses must agree to fp32 reduction order (the
contract: 1e-5 relative). Prints one JSON object: per run the losses from its metrics file and the largest relative
difference to the reference.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = [("tiny_cpu.yaml", 2), ("tiny_cpu_cp_ring.yaml", 2), ("tiny_cpu_cp_ulysses.yaml", 2),
        ("tiny_cpu_cp_hybrid.yaml", 4), ("tiny_cpu_fpdt.yaml", 2)]


def run(config: str, ranks: int, steps: int, tmp: str) -> list:
    metrics = os.path.join(tmp, config + ".jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "pretrain_gpt.py",
           "--config", os.path.join("configs", config), "--set", f"train.train_iters={steps}",
           "--set", "checkpoint.save=null", "--set", f"logging.metrics_file={metrics}"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(metrics) as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for config, ranks in RUNS:
            out[config] = {"ranks": ranks, "losses": run(config, ranks, args.steps, tmp)}
    ref = out[RUNS[0][0]]["losses"]
    for r in out.values():
        r["max_rel_diff_vs_cp1"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
    print(json.dumps({"steps": args.steps, "runs": out}, indent=1))


if __name__ == "__main__":
    main()
