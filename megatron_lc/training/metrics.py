"""Throughput, MFU and memory figures of a step.

Model FLOPs per sample (Memo §5.1, FlashAttention with the causal mask): ``6*s*P + 6*n*h*s^2`` with s the sequence
length, P the parameter count (of an MoE layer the parameters one token passes through: its router, top-k
experts and shared expert, ``ModelConfig.num_active_parameters``), n the number of layers and h the hidden size;
``12*n*h`` per attended (query, key) pair, of which a causal sample has ``s^2 / 2`` -- with document masks (``data.reset_attention_mask``) or sliding
windows (``model.sliding_window``) the step's own count from the host's document ranges, the sum over documents of
``len^2 / 2``, each query at most W keys, averaged over the layers (``attention/masks.attended_pairs``). MFU = model
FLOPs per second / (devices x peak), the peak ``logging.peak_tflops`` or, unset, measured before the first step on
this device (``measure_peak``: the median of short square GEMMs in the training dtype timed for half a second with
this process's threads; the log says which, and the spread). An MFU above 100% means the peak is wrong for this machine:
it is reported once (rank 0) and left out, never printed."""
from __future__ import annotations

import functools
import resource
import statistics
import sys
import time
from typing import Optional

import torch

from ..attention.masks import attended_pairs
from ..config import Config, Execution, Layout


def flops_per_sample(cfg: Config, pairs: Optional[float] = None) -> float:
    """``pairs``: attended (query, key) pairs per sample (None: causal over the whole sequence, ``s^2 / 2``)."""
    s, m = cfg.data.seq_length, cfg.model
    pairs = s * s / 2 if pairs is None else pairs
    return 6.0 * s * m.num_active_parameters() + 12.0 * m.num_layers * m.hidden_size * pairs


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """Peak allocated device memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.max_memory_allocated(device))
        except RuntimeError:  # a pluggable allocator keeps no statistics (planning/replay_cuda.py)
            return None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


BASELINE_SECONDS = 0.5  # how long the GEMM baseline is timed
BASELINE_SAMPLES = (5, 2000)  # at least, at most
# the baseline GEMM's size: on a CPU one short enough to run within one scheduler time slice of a shared core (256:
# 0.25 ms on one thread), so a sample times the core, not the other jobs. On 2 cores under a load of 10, one
# thread: 256 x 256 GEMMs, median 130-133 GFLOP/s in three seconds, what 1024 x 1024 ones give on an idle machine
# (128-133); 1024 x 1024 ones under that load 15-18 -- and the single timing this replaced ranged 65-144 between runs
BASELINE_GEMM = {"cuda": 8192, "cpu": 256}


@functools.lru_cache(maxsize=None)
def measure_peak(device: torch.device, dtype: torch.dtype, n: int) -> tuple[float, list[float]]:
    """(median FLOP/s, every sample's FLOP/s) of ``n x n`` GEMMs on ``device`` timed one by one for
    ``BASELINE_SECONDS`` after one warm-up; once per process. The median of many short ones: a moment when other
    work had the cores is a few samples among hundreds."""
    g = torch.Generator(device=device).manual_seed(0)  # the training RNG stays untouched
    a = torch.randn(n, n, device=device, generator=g).to(dtype)
    b = torch.randn(n, n, device=device, generator=g).to(dtype)
    torch.mm(a, b)  # warm-up: the library's first call sets itself up
    low, high = BASELINE_SAMPLES
    rates: list[float] = []
    start = time.perf_counter()
    while len(rates) < high and (len(rates) < low or time.perf_counter() - start < BASELINE_SECONDS):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        rates.append(2.0 * n ** 3 / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def peak_flops(cfg: Config, execution: Execution) -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained) for MFU: ``logging.peak_tflops``, or the median of GEMMs in
    the run's compute dtype timed for half a second (``measure_peak``), said with their spread, e.g. ``measured:
    fp32 GEMM 256x256, median of 590 over 0.5 s (0.0921-0.144 TFLOP/s); logging.peak_tflops fixes it``."""
    if cfg.logging.peak_tflops is not None:
        return cfg.logging.peak_tflops * 1e12, "logging.peak_tflops"
    device, dtype = execution.device, execution.compute_dtype
    n = BASELINE_GEMM["cuda" if device.type == "cuda" else "cpu"]
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    median, rates = measure_peak(device, dtype, n)
    return median, (f"measured: {name} GEMM {n}x{n}, median of {len(rates)} over {BASELINE_SECONDS:g} s "
                    f"({min(rates) / 1e12:.3g}-{max(rates) / 1e12:.3g} TFLOP/s); logging.peak_tflops fixes it")


def step_counts(batches: list[dict], layout: Layout) -> torch.Tensor:
    """This rank's ``[valid tokens, attended pairs, micro-batches with masks or windows]`` of a step (float64), for
    the loop's one all-reduce over dp x cp: the loss's global token count and MFU's attended pairs (every cp rank
    holds the full-sequence document ranges, so the pairs are counted cp times; ``pairs_per_sample`` divides). The
    pairs come from host integers (``DocumentRanges``, the layout's windows): no device value is read."""
    windowed = any(w is not None for w in layout.windows)
    restricted = [b for b in batches if windowed or b.get("documents") is not None]
    pairs = sum(attended_pairs(b.get("documents"), layout.windows, layout.seq_length, b["tokens"].shape[0])
                for b in restricted)
    tokens = torch.stack([b["loss_mask"].sum(dtype=torch.float64) for b in batches]).sum()
    rest = torch.tensor([pairs, len(restricted)], dtype=torch.float64, device=tokens.device)
    return torch.cat([tokens.view(1), rest])


def pairs_per_sample(counts: torch.Tensor, layout: Layout) -> Optional[float]:
    """The step's mean attended pairs per sample from the all-reduced ``step_counts`` (None without document
    masks or windows: causal over the whole sequence)."""
    return float(counts[1]) / layout.cp / layout.global_batch_size if float(counts[2]) else None


def step_metrics(cfg: Config, layout: Layout, step_seconds: float, peak: float,
                 pairs: Optional[float] = None) -> dict:
    """``pairs``: the step's mean attended pairs per sample under document masks (None: no masks)."""
    world_size = layout.world_size
    tokens = layout.global_batch_size * cfg.data.seq_length
    tps = tokens / step_seconds
    flops = layout.global_batch_size * flops_per_sample(cfg, pairs) / step_seconds
    return {
        "tokens_per_s": tps,
        "tokens_per_gpu_per_s": tps / world_size,
        "tflops_per_gpu": flops / world_size / 1e12,
        "mfu": flops / (world_size * peak),
    }
