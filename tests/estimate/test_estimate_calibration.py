"""Calibration: the memory model against the measured peak of the framework's own CPU runs (tiny model).

Each case (``tests/support/estimate_cases.py``) trains ``configs/tiny_cpu.yaml`` (4 layers, hidden 256, GQA 8/2 heads,
vocab 8000; seq 512, micro-batch 1, random tokens) for 2 steps in fresh gloo processes and measures every rank's
peak of live tensor bytes (``megatron_lc/estimate/measure.py``); the estimate for the same config (``device: cpu``,
fp32) must be within 10% of the largest rank's peak. Adding a feature combination is one line in
``estimate_cases.CASES``; a case whose feature is not implemented in this checkout is skipped with the reason.
Cases marked ``bench_only`` repeat a code path with other sizes and run only in ``bench/estimate_calibration.py``.
"""
from __future__ import annotations

import pytest

from megatron_lc.estimate import estimate
from megatron_lc.estimate.hardware import load_hardware
from tests.support import estimate_cases
from tests.support.dist import run_dist

TOLERANCE = 0.10  # the target; the figures per case are in docs/estimator.md (bench/estimate_calibration.py)


def _params():
    for case in estimate_cases.CASES:
        name, world, overrides = case[:3]
        opts = case[3] if len(case) > 3 else {}
        if opts.get("bench_only"):
            continue
        marks = [pytest.mark.xfail(reason=opts["xfail"], strict=False)] if "xfail" in opts else []
        yield pytest.param(name, world, overrides, opts.get("tolerance", TOLERANCE), opts.get("expert_load"), id=name,
                           marks=marks)


@pytest.mark.parametrize("name,world,overrides,tolerance,expert_load", list(_params()))
def test_memory_model_matches_measured_peak(name, world, overrides, tolerance, expert_load):
    cfg = estimate_cases.case_config(world, overrides)
    reason = estimate_cases.missing_feature(cfg, world)
    if reason:
        pytest.skip(reason)
    results = run_dist(world, estimate_cases.measure_case, overrides)
    measured = max(r["peak_bytes"] for r in results)
    est = estimate(cfg, load_hardware("cpu"), world_size=world, expert_load=expert_load)
    err = est.memory.peak / measured - 1.0
    assert abs(err) <= tolerance, (
        f"{name}: estimated {est.memory.peak / 2**20:.2f} MiB ({est.memory.peak_phase}) vs measured "
        f"{measured / 2**20:.2f} MiB (max over {world} ranks): {err:+.1%}; phases "
        + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in est.memory.phases.items()))
