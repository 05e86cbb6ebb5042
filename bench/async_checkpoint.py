"""The training stall per checkpoint save, synchronous vs asynchronous (``checkpoint.async_save``), on a ~125M-parameter
Llama in one process, side by side in one run.

    python bench/async_checkpoint.py [--saves 3] > bench/results/async_checkpoint_DATE.json

The model: 12 layers, hidden 768, 12 heads, SwiGLU FFN 2048, vocabulary 32000 untied (134M parameters; with AdamW
16 bytes each, 2.0 GiB per checkpoint), sequence 128, one sample per step, mock tokens, fp32 on CPU. Each mode trains
``2 x saves`` steps with a save every 2 steps. The stall of a save is the time ``Trainer.save`` keeps the loop: the
whole write (synchronous) or the wait for the previous save plus staging the state in host memory (asynchronous);
the asynchronous mode's background write time and the steps' time are printed too (on a 2-core machine the
background write takes cores from the steps). ``ratio``: mean synchronous stall / mean asynchronous stall.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

MODEL = ["model.num_layers=12", "model.hidden_size=768", "model.num_attention_heads=12", "model.num_query_groups=12",
         "model.ffn_hidden_size=2048", "model.vocab_size=32000", "data.seq_length=128", "data.mock_data=true",
         "train.micro_batch_size=1", "train.global_batch_size=1", "train.device=cpu", "logging.peak_tflops=1",
         "logging.log_interval=1000", "checkpoint.save_interval=2"]


def run(mode: str, saves: int, tmp: str) -> dict:
    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    cfg = load_config(None, MODEL + [f"train.train_iters={2 * saves}", f"checkpoint.save={tmp}/{mode}",
                                     f"checkpoint.async_save={mode == 'async'}",
                                     f"logging.metrics_file={tmp}/{mode}.jsonl"])
    trainer = Trainer(cfg, Topology())
    stalls = []
    original = trainer.save

    def timed_save():
        t0 = time.perf_counter()
        original()
        stalls.append(time.perf_counter() - t0)

    trainer.save = timed_save
    t0 = time.perf_counter()
    state = trainer.train()
    total = time.perf_counter() - t0
    steps = [json.loads(line)["step_seconds"] for line in open(f"{tmp}/{mode}.jsonl")]
    out = {"params": cfg.model.num_parameters(), "saves": len(stalls), "stall_seconds": [round(s, 3) for s in stalls],
           "mean_stall_seconds": round(statistics.mean(stalls), 3), "step_seconds": [round(s, 3) for s in steps],
           "run_seconds": round(total, 2), "iterations": state.iteration}
    if trainer.async_checkpoints is not None:
        out["async_staging_seconds"] = [round(s, 3) for s in trainer.async_checkpoints.stall_seconds]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = {mode: run(mode, args.saves, tmp) for mode in ("sync", "async")}
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(f"{tmp}/sync/iter_{2:07d}")
                   for f in fs)
    print(json.dumps({"model": "Llama 12 x 768, vocab 32000, fp32 + AdamW", "checkpoint_bytes": size,
                      "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0], **res,
                      "ratio_sync_over_async_stall": round(res["sync"]["mean_stall_seconds"]
                                                           / res["async"]["mean_stall_seconds"], 2)}, indent=1))


if __name__ == "__main__":
    main()
