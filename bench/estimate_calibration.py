"""The estimator against the framework's own CPU runs; prints JSON.

    python bench/estimate_calibration.py                 # memory: every case this checkout implements
    python bench/estimate_calibration.py plain tp2-sp    # some cases
    python bench/estimate_calibration.py --time [--reps 3] [case ...]    # step time (tests/support/step_time_cases.py)
    python bench/estimate_calibration.py --profile [--reps 3]           # the CPU profile's peak, attention, overhead

Memory: measured = max over ranks of the peak of live tensor bytes over 2 training steps
(megatron_lc/estimate/measure.py), each case in fresh gloo processes; estimated = megatron_lc.estimate.estimate(cfg,
hardware "cpu", world). Step time: each case beside its reference (the plain model, or data parallel over as many
ranks) in one fresh process per rank, their steps in turn (``tests/support/step_time_cases.time_pair``: the median of
4 pairs' ratios, CPU seconds, after a warm-up step), ``--reps`` such processes, the median of their ratios (a step's:
its slowest rank's) against the estimator's ratio. ``--profile``: the plain model alone at 512, 1024, 2048 and 4096
tokens the same way (two pairs), the estimator's linears, attention and fixed work fitted to its steps
(``step_time_cases.fit_profile``): what configs/hardware/cpu.yaml's ``peak_tflops_fp32``, ``attention.torch`` and
``step_overhead_seconds`` are set from (the calibration; the ``--time`` cases validate).
"""
from __future__ import annotations

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main(names: list) -> dict:
    from megatron_lc.estimate import estimate, load_hardware
    from tests.support import estimate_cases
    from tests.support.dist import run_dist

    rows = []
    for case in estimate_cases.CASES:
        name, world, overrides = case[:3]
        if names and name not in names:
            continue
        cfg = estimate_cases.case_config(world, overrides)
        reason = estimate_cases.missing_feature(cfg, world)
        if reason:
            rows.append({"case": name, "ranks": world, "skipped": reason})
            continue
        t0 = time.time()
        res = run_dist(world, estimate_cases.measure_case, overrides)
        measured = max(r["peak_bytes"] for r in res)
        est = estimate(cfg, load_hardware("cpu"), world_size=world)
        rows.append({"case": name, "ranks": world, "measured_mib": round(measured / 2**20, 3),
                     "per_rank_mib": [round(r["peak_bytes"] / 2**20, 3) for r in res],
                     "estimated_mib": round(est.memory.peak / 2**20, 3), "estimated_phase": est.memory.peak_phase,
                     "error": round(est.memory.peak / measured - 1.0, 4), "seconds": round(time.time() - t0, 1),
                     **({"known_issue": case[3]["xfail"]} if len(case) > 3 and "xfail" in case[3] else {})})
        print(json.dumps(rows[-1]), file=sys.stderr)
    return {"bench": "estimate_calibration", "tolerance": 0.10, "cases": rows}


def main_time(names: list, reps: int) -> dict:
    import statistics

    from megatron_lc.estimate import estimate, load_hardware
    from tests.support import estimate_cases, step_time_cases as stc
    from tests.support.dist import run_dist

    hw = load_hardware("cpu")
    world_of = {c[0]: c[1] for c in stc.CASES}
    over = {c[0]: stc.case_overrides(c[1], c[2]) for c in stc.CASES}
    rows = []
    for name, world, _ in stc.CASES:
        ref = stc.REFERENCE[world]
        if name == ref or (names and name not in names):
            continue
        runs = []
        for rep in range(reps):  # a fresh process (per rank) per measurement
            res = run_dist(world, stc.time_pair, over[ref], over[name])
            slowest = max(res, key=lambda r: r["case_s"])  # a step is as long as its slowest rank
            runs.append(slowest)
            print(json.dumps({"case": name, "rep": rep, **slowest}), file=sys.stderr)
        est_ratio = (estimate(estimate_cases.case_config(world, over[name]), hw, world).time.step_seconds /
                     estimate(estimate_cases.case_config(world_of[ref], over[ref]), hw, world).time.step_seconds)
        m = statistics.median(r["ratio"] for r in runs)
        rows.append({"case": name, "ranks": world, "reference": ref, "measured_ratio": round(m, 4),
                     "measured_ratios": [round(r["ratio"], 4) for r in runs],
                     "wall_ratios": [round(r["wall_ratio"], 4) for r in runs],
                     "case_s": [round(r["case_s"], 3) for r in runs],
                     "reference_s": [round(r["reference_s"], 3) for r in runs],
                     "estimated_ratio": round(est_ratio, 4), "error": round(est_ratio / m - 1, 4)})
    return {"bench": "estimate_calibration --time", "tolerance": 0.15, "reps": reps, "cases": rows}


def plain_parts(hw, n: int) -> tuple:
    """The estimator's step of the plain model at ``n`` tokens on profile ``hw`` (no step overhead) in three parts:
    (linears and the rest, attention, optimizer) seconds. A step's attention seconds are inversely proportional to
    the kernel's efficiency, so the attention part is twice the step's drop when that efficiency is doubled."""
    import dataclasses

    from megatron_lc.estimate import estimate
    from tests.support import estimate_cases

    cfg = estimate_cases.case_config(1, [f"data.seq_length={n}"])
    fig = hw.attention["torch"]
    twice = dataclasses.replace(hw, attention={"torch": dataclasses.replace(fig, fwd=fig.fwd / 2, bwd=fig.bwd / 2)})
    t, slow = estimate(cfg, hw, 1).time, estimate(cfg, twice, 1).time
    attention = slow.step_seconds - t.step_seconds  # half the efficiency: the attention's seconds once more
    opt = t.parts["optimizer"]
    return t.step_seconds - attention - opt, attention, opt


def main_profile(reps: int) -> dict:
    import dataclasses
    import statistics

    from megatron_lc.estimate import load_hardware
    from tests.support import step_time_cases as stc
    from tests.support.dist import run_dist

    hw = dataclasses.replace(load_hardware("cpu"), step_overhead_seconds=0.0)
    runs, measured = [], {}
    for long_, short in stc.PROFILE_PAIRS:  # a fresh process per measurement, the short step beside the long one
        pair = [run_dist(1, stc.time_pair, [f"data.seq_length={long_}"], [f"data.seq_length={short}"])[0]
                for _ in range(reps)]
        runs.append({"lengths": [long_, short], "runs": pair})
        measured[long_] = statistics.median(r["reference_s"] for r in pair)
        measured[short] = statistics.median(r["case_s"] for r in pair)
    parts = {n: plain_parts(hw, n) for n in stc.PROFILE_LENGTHS}
    fit = stc.fit_profile(measured, parts)
    fig = hw.attention["torch"]
    return {"bench": "estimate_calibration --profile", "reps": reps, "runs": runs,
            "measured_s": {n: round(measured[n], 4) for n in stc.PROFILE_LENGTHS},
            "estimated_parts_s": {n: [round(x, 4) for x in parts[n]] for n in stc.PROFILE_LENGTHS},
            "fitted_s": {n: round(fit["gemm"] * parts[n][0] + fit["attention"] * parts[n][1] + parts[n][2]
                                  + fit["step_overhead_seconds"], 4) for n in stc.PROFILE_LENGTHS},
            "fit": {k: round(v, 4) for k, v in fit.items()},
            "profile": {"peak_tflops_fp32": round(hw.peak_tflops_fp32 / fit["gemm"], 4),
                        "attention_torch": round(fig.fwd * fit["gemm"] / fit["attention"], 3),
                        "step_overhead_seconds": round(fit["step_overhead_seconds"], 3)},
            "profile_before": {"peak_tflops_fp32": hw.peak_tflops_fp32, "attention_torch": [fig.fwd, fig.bwd]}}


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--profile" in argv:
        reps = int(argv[argv.index("--reps") + 1]) if "--reps" in argv else 3
        print(json.dumps(main_profile(reps), indent=1))
        sys.exit(0)
    if "--time" in argv:
        reps = int(argv[argv.index("--reps") + 1]) if "--reps" in argv else 3
        rest = [a for i, a in enumerate(argv) if a not in ("--time", "--reps") and
                (i == 0 or argv[i - 1] != "--reps")]
        print(json.dumps(main_time(rest, reps), indent=1))
    else:
        print(json.dumps(main(argv), indent=1))
