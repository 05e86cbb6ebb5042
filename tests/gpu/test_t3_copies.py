"""T3: host <-> device copies as the offload techniques use them: pinned vs pageable bandwidth, and whether a copy
on a side stream overlaps compute (a matmul with a concurrent 256 MiB copy slows by at most 5%)."""
import time

import pytest
import torch

from megatron_lc.device import DeviceAdapter

MiB = 1 << 20


def _seconds(fn, device, repeats=5) -> float:
    fn()
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def test_pinned_and_pageable_bandwidth(device, record):
    if device.type != "cuda":
        pytest.skip("CUDA only")
    n = 256 * MiB
    src = torch.empty(n, dtype=torch.uint8, device=device)
    pinned = DeviceAdapter.for_device(device).host_empty((n,), torch.uint8)
    pageable = torch.empty(n, dtype=torch.uint8)
    figures = {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        d2h = _seconds(lambda: host.copy_(src, non_blocking=True), device)
        h2d = _seconds(lambda: src.copy_(host, non_blocking=True), device)
        figures[name] = {"d2h_GBps": round(n / d2h / 1e9, 1), "h2d_GBps": round(n / h2d / 1e9, 1)}
    record("T3 copy bandwidth (256 MiB)", "GB/s", figures)
    assert figures["pinned"]["d2h_GBps"] >= figures["pageable"]["d2h_GBps"]


def test_side_stream_copy_overlaps_compute(device, record):
    if device.type != "cuda":
        pytest.skip("CUDA only")
    dev = DeviceAdapter.for_device(device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    src = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    host = dev.host_empty((256 * MiB,), torch.uint8)
    stream = dev.new_stream()

    def compute():
        for _ in range(8):
            a @ a

    def both():
        with dev.stream(stream):
            host.copy_(src, non_blocking=True)
        compute()

    alone, together = _seconds(compute, device), _seconds(both, device)
    copy = _seconds(lambda: host.copy_(src, non_blocking=True), device)
    record("T3 copy/compute overlap", "8 bf16 8192^2 matmuls + a 256 MiB d2h copy on a side stream",
           {"compute_s": round(alone, 4), "copy_s": round(copy, 4), "both_s": round(together, 4),
            "slowdown": round(together / alone, 3)})
    assert together <= 1.05 * max(alone, copy), (alone, copy, together)
