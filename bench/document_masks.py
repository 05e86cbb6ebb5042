"""Document masks and sliding windows as ranges, measured on the CPU: what they cost next to plain causal attention.

    python bench/document_masks.py [--seq 16384] [--window-seq 32768] [--out bench/results/document_masks.json]

1. The tiny model of configs/tiny_cpu.yaml, one process, one micro-batch of ``--seq`` mock tokens (fp32): training
   steps without documents; with the document options on random tokens (a few documents a sample); with one
   document a sample (nothing masked: the ranges' own cost); with mock packed documents
   (``data.mean_document_length`` 4096 and 512); with a 1024-token window on every layer. Per case the peak RSS of
   its process (``resource.getrusage``) and the median step time of 3 steps after a warm-up.
2. The core attention alone (the tiny model's heads: 8 query, 2 kv, head dim 32) on ``--window-seq`` tokens,
   forward + backward: full causal attention vs a 1024-token window (the median of 3 after a warm-up).

Every case runs in a fresh subprocess, one after the other, so each peak RSS is that case's alone, with
``--threads`` torch threads (default 1: on a shared 2-core machine two threads wait on each other in every small
op and the timings scatter by 3x). JSON on stdout (and ``--out``), a side-by-side table with the ratios to the plain
case on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true"]
STEP_CASES = {  # name -> overrides of configs/tiny_cpu.yaml
    "causal": [],
    # the options on random mock tokens: a few random end-of-document ids a sample, so nearly nothing is masked and
    # the ranges' overhead shows (the case "today" measured with its dense masks)
    "documents_few": DOCS,
    # one document a sample (mock documents far longer than the sample): nothing masked, the ranges' pure overhead
    "documents_one": DOCS + ["data.mean_document_length=1000000000"],
    "documents_4096": DOCS + ["data.mean_document_length=4096"],
    "documents_512": DOCS + ["data.mean_document_length=512"],
    "window_1024": ["model.sliding_window=1024"],
}
ATTENTION_CASES = {"full": None, "window_1024": 1024}


def _rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def step_case(name: str, seq: int) -> dict:
    """Training steps of one case in this (fresh) process."""
    import torch

    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    torch.manual_seed(0)
    cfg = load_config(os.path.join(ROOT, "configs/tiny_cpu.yaml"), STEP_CASES[name] + [
        f"data.seq_length={seq}", "data.prepare_demo_data=false", "data.mock_data=true", "train.micro_batch_size=1",
        "train.global_batch_size=1", "train.train_iters=4", "checkpoint.save=", "logging.log_interval=100",
        "logging.peak_tflops=1", f"model.max_position_embeddings={seq}"])
    trainer = Trainer(cfg, Topology())
    seconds = []
    for k in range(4):
        t0 = time.perf_counter()
        trainer.train_step(k)
        trainer.state.iteration += 1
        trainer.state.consumed_samples += 1
        seconds.append(time.perf_counter() - t0)
    return {"case": name, "seq": seq, "step_s": statistics.median(seconds[1:]), "peak_rss_bytes": _rss_bytes()}


def attention_case(name: str, seq: int) -> dict:
    """Forward + backward of the core attention alone in this (fresh) process."""
    import torch

    from megatron_lc.attention.local import LocalCausalAttention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(seq, 1, 8, 32, generator=g, requires_grad=True)
    k, v = (torch.randn(seq, 1, 2, 32, generator=g, requires_grad=True) for _ in range(2))
    att = LocalCausalAttention("torch", ATTENTION_CASES[name])
    seconds = []
    for _ in range(4):
        t0 = time.perf_counter()
        att(q, k, v).sum().backward()
        seconds.append(time.perf_counter() - t0)
    return {"case": name, "seq": seq, "fwd_bwd_s": statistics.median(seconds[1:]), "peak_rss_bytes": _rss_bytes()}


def _fresh(kind: str, name: str, seq: int, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", kind, name, str(seq)], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--window-seq", type=int, default=32768)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all; the first is the base)")
    ap.add_argument("--one", nargs=3, metavar=("KIND", "NAME", "SEQ"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        kind, name, seq = args.one
        print(json.dumps((step_case if kind == "step" else attention_case)(name, int(seq))))
        return
    chosen = args.cases.split(",") if args.cases else list(STEP_CASES) + [f"attention_{n}" for n in ATTENTION_CASES]
    steps = [_fresh("step", n, args.seq, args.threads) for n in chosen if n in STEP_CASES]
    attn = [_fresh("attention", n[len("attention_"):], args.window_seq, args.threads) for n in chosen
            if n.startswith("attention_")]
    base, full = (steps or [None])[0], (attn or [None])[0]
    for r in steps:
        r["rss_vs_causal"] = round(r["peak_rss_bytes"] / base["peak_rss_bytes"], 3)
        r["time_vs_causal"] = round(r["step_s"] / base["step_s"], 3)
    for r in attn:
        r["time_vs_full"] = round(r["fwd_bwd_s"] / full["fwd_bwd_s"], 4)
    result = {"command": "python bench/document_masks.py " + " ".join(sys.argv[1:]), "steps": steps,
              "attention": attn, "torch_threads": args.threads}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'case':16} {'peak RSS GB':>11} {'x causal':>8} {'step s':>7} {'x causal':>8}", file=sys.stderr)
    for r in steps:
        print(f"{r['case']:16} {r['peak_rss_bytes'] / 1e9:11.2f} {r['rss_vs_causal']:8.2f} {r['step_s']:7.2f} "
              f"{r['time_vs_causal']:8.2f}", file=sys.stderr)
    for r in attn:
        print(f"attention {r['case']:12} {r['seq']} tokens fwd+bwd {r['fwd_bwd_s']:.3f} s  x full "
              f"{r['time_vs_full']:.4f}", file=sys.stderr)


if __name__ == "__main__":
    main()
