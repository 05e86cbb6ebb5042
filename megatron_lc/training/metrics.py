"""Throughput, MFU and memory figures of a step.

Model FLOPs per sample (Memo §5.1, FlashAttention with the causal mask): ``6*s*P + 6*n*h*s^2`` with s the sequence
length, P the parameter count, n the number of layers and h the hidden size. MFU = model FLOPs per second /
(devices x ``logging.peak_tflops``)."""
from __future__ import annotations

import resource
import sys

import torch

from ..config import Config, Layout


def flops_per_sample(cfg: Config) -> float:
    s, m = cfg.data.seq_length, cfg.model
    return 6.0 * s * m.num_parameters() + 6.0 * m.num_layers * m.hidden_size * s * s


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA) or peak resident set size of this process (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def step_metrics(cfg: Config, layout: Layout, step_seconds: float) -> dict:
    world_size = layout.world_size
    tokens = layout.global_batch_size * cfg.data.seq_length
    tps = tokens / step_seconds
    flops = layout.global_batch_size * flops_per_sample(cfg) / step_seconds
    return {
        "tokens_per_s": tps,
        "tokens_per_gpu_per_s": tps / world_size,
        "tflops_per_gpu": flops / world_size / 1e12,
        "mfu": flops / (world_size * cfg.logging.peak_tflops * 1e12),
    }
