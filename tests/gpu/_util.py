"""Helpers of the GPU check's T4-T6: the model shapes, the fresh-process worker (``bench/gpu_worker.py``), the
time budget, the longest-sequence search, copy/compute overlap from a profiler trace, MFU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import yaml

from megatron_lc.config import load_config
from megatron_lc.training.metrics import flops_per_sample
from tests.gpu.conftest import DRYRUN

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "bench", "gpu_worker.py")

# Llama-3.2-1B (tied embeddings); the dry run's tiny stand-in
LLAMA_1B = dict(hidden_size=2048, num_layers=16, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=8192,
                vocab_size=128256, rotary_base=500000)
TINY = dict(hidden_size=64, num_layers=3, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
            vocab_size=256, rotary_base=500000)
MODEL = TINY if DRYRUN else LLAMA_1B

MFU_FORMULA = ("MFU = (6*s*P + 12*n*h*s^2/2) * (tokens/s / s) / peak; s tokens per sample, P parameters (padded "
               "vocab, tied embedding counted once), n layers, h hidden; the causal attention counted as s^2/2 "
               "attended pairs (megatron_lc/training/metrics.flops_per_sample); peak the device's dense bf16 "
               "datasheet figure (configs/hardware)")


def deadline() -> float:
    """When the whole GPU check must be done (``GPU_CHECK_DEADLINE``, epoch seconds, set by scripts/gpu_check.sh)."""
    return float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 3600))


def peak_tflops(device_name: str):
    """The dense bf16 peak of ``configs/hardware`` whose file name is in the device name (H100, H200, A100)."""
    name = device_name.lower().replace(" ", "")
    for f in ("h200", "h100", "a100"):
        if f in name:
            with open(os.path.join(ROOT, "configs", "hardware", f + ".yaml")) as fh:
                return float(yaml.safe_load(fh)["peak_tflops_bf16"])
    return None


def mfu(seq: int, tokens_per_s: float, peak: float, model: dict = None) -> float:
    """``MFU_FORMULA`` for the Llama shape ``model`` at ``seq`` tokens per sample."""
    cfg = load_config(None, [f"model.{k}={v}" for k, v in (model or MODEL).items()] + [
        "model.untie_embeddings_and_output_weights=false", "model.make_vocab_size_divisible_by=128",
        f"model.max_position_embeddings={seq}", f"data.seq_length={seq}"])
    return flops_per_sample(cfg) * tokens_per_s / seq / (peak * 1e12)


def run_worker(spec: dict, timeout: float) -> dict:
    """One point in a fresh process (``bench/gpu_worker.py``); a point past ``timeout`` seconds is killed."""
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, WORKER, json.dumps(spec)], capture_output=True, text=True,
                           timeout=max(timeout, 1), cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"ok": False, "oom": False, "timeout": True, "error": f"killed after {timeout:.0f} s",
                "wall_s": round(time.time() - t0, 1)}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("GPU_WORKER_RESULT ")]
    if not lines:
        return {"ok": False, "oom": False, "error": f"worker exit {p.returncode}: {p.stderr[-500:]}",
                "wall_s": round(time.time() - t0, 1)}
    res = json.loads(lines[-1][len("GPU_WORKER_RESULT "):])
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def tokens_per_s(res: dict, seq: int) -> float:
    """Tokens per second of the fastest step after the first (the first when there is only one)."""
    steps = res["step_s"][1:] or res["step_s"]
    return seq / min(steps)


def longest(point, start: int, granularity: int, cap: int, budget_s: float) -> dict:
    """The longest ``seq`` with ``point(seq, time_left) -> result`` ok: doubling from ``start`` until a failure (or
    ``cap``), then bisection down to ``granularity``, as long as ``budget_s`` lasts. Returns the longest ok length
    (0: none), the first failing one (None: none found), every point in order and why the search stopped."""
    end = time.time() + budget_s
    ok, bad, points = 0, None, {}

    def attempt(seq):
        left = end - time.time()
        if left <= 0:
            return None
        res = point(seq, left)
        points[seq] = res
        return res

    seq, stopped = start, None
    while bad is None:
        if seq > cap:
            stopped = "cap"
            break
        res = attempt(seq)
        if res is None:
            stopped = "budget"
            break
        if res["ok"]:
            ok, seq = seq, seq * 2
        elif res.get("timeout"):
            stopped = "point timeout"
            break
        else:
            bad = seq
    while stopped is None and bad - ok > granularity:
        mid = (ok + bad) // 2 // granularity * granularity
        mid = mid if mid > ok else ok + granularity
        res = attempt(mid)
        if res is None:
            stopped = "budget"
        elif res["ok"]:
            ok = mid
        elif res.get("timeout"):
            stopped = "point timeout"
        else:
            bad = mid
    return {"longest": ok, "first_failing": bad, "stopped": stopped or f"resolved to {granularity}",
            "points": points}


def merged(intervals: list) -> list:
    """Union of ``(start, end)`` intervals as sorted disjoint intervals."""
    out = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [tuple(i) for i in out]


def overlap_fraction(copies: list, compute: list) -> float:
    """Fraction of the total copy time during which some compute kernel runs (1.0 when there is no copy)."""
    total = sum(e - s for s, e in merged(copies))
    if total == 0:
        return 1.0
    busy = merged(compute)
    covered = 0.0
    for s, e in merged(copies):
        for bs, be in busy:
            covered += max(0.0, min(e, be) - max(s, bs))
    return covered / total


def trace_intervals(trace: dict) -> dict:
    """From a Chrome trace of ``torch.profiler``: host<->device copy intervals (``gpu_memcpy`` HtoD / DtoH), compute
    kernel intervals (``kernel``), in microseconds, and the bytes copied."""
    copies, compute, nbytes = [], [], 0
    for ev in trace.get("traceEvents", []):
        cat, name = ev.get("cat", ""), ev.get("name", "")
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        span = (float(ev["ts"]), float(ev["ts"]) + float(ev["dur"]))
        if cat == "gpu_memcpy" and ("HtoD" in name or "DtoH" in name):
            copies.append(span)
            nbytes += int(ev.get("args", {}).get("bytes", 0))
        elif cat == "kernel":
            compute.append(span)
    return {"copies": copies, "compute": compute, "copy_bytes": nbytes}
