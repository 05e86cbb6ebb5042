"""Estimated vs measured peak memory per rank for every calibration case (tests/support/estimate_cases.py); prints JSON.

    python bench/estimate_calibration.py                 # all cases this checkout implements
    python bench/estimate_calibration.py plain tp2-sp    # some cases

Measured: max over ranks of the peak of live tensor bytes over 2 training steps (megatron_lc/estimate/measure.py),
each case in fresh gloo processes. Estimated: megatron_lc.estimate.estimate(cfg, hardware "cpu", world).
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


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
