"""Wall clock of ring attention with packed documents on the CPU, zigzag vs the balanced layout, side by side in one
run: the tiny model (``configs/tiny_cpu_cp_ring.yaml``'s) at 16K-64K tokens, mock documents, ring cp 4 (4 gloo
ranks through torchrun), the same data, seed and steps for both layouts, alternated run by run.

    python bench/document_layout_speed.py [--seq 16384] [--mean-document-length 4096] [--steps 4] [--rounds 2]

Prints one JSON object: per layout the median step time over every run's steps after the first (the first holds
the set-up's warm-up), the losses of the first run (equal to fp32 reduction order: the layouts are exact), and the
ratio zigzag / balanced. On this machine 4 ranks share 2 cores: the ranks' imbalance costs less than on GPUs (a
waiting rank frees its core), the bytes moved on gloo count in full; the estimator's figures
(``tools/estimate.py``) and ``bench/document_balance.py`` give the GPU-scale picture.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("zigzag", "balanced")


def run(layout: str, seq: int, mean: int, steps: int, tmp: str, k: int) -> list:
    metrics = os.path.join(tmp, f"{layout}-{k}.jsonl")
    sets = ["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p", f"parallel.cp_layout={layout}",
            f"data.seq_length={seq}", "model.max_position_embeddings=65536", "data.prepare_demo_data=false",
            "data.mock_data=true", f"data.mean_document_length={mean}", "data.reset_position_ids=true",
            "data.reset_attention_mask=true", "data.eod_mask_loss=true", "train.micro_batch_size=1",
            "train.global_batch_size=1", f"train.train_iters={steps}", "checkpoint.save=null",
            f"logging.metrics_file={metrics}", "logging.log_interval=1000"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "pretrain_gpt.py",
           "--config", "configs/tiny_cpu_cp_ring.yaml"] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))
    with open(metrics) as f:
        return [json.loads(line) for line in f if '"step_seconds"' in line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--mean-document-length", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each layout, alternated")
    args = ap.parse_args()
    times = {name: [] for name in LAYOUTS}
    losses = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            for name in LAYOUTS:
                records = run(name, args.seq, args.mean_document_length, args.steps, tmp, k)
                times[name] += [r["step_seconds"] for r in records[1:]]
                losses.setdefault(name, [r["loss"] for r in records])
    out = {"seq": args.seq, "mean_document_length": args.mean_document_length, "cp": 4, "steps": args.steps,
           "rounds": args.rounds,
           "layouts": {n: {"median_step_seconds": round(statistics.median(times[n]), 3), "losses": losses[n]}
                       for n in LAYOUTS}}
    out["zigzag_over_balanced"] = round(out["layouts"]["zigzag"]["median_step_seconds"]
                                        / out["layouts"]["balanced"]["median_step_seconds"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
