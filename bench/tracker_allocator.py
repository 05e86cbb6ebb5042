"""The live-bytes tracker against the CPU allocator's own count: one process (one rank), the framework's training
steps on ``configs/tiny_cpu.yaml`` (the calibration cases' base, ``tests/support/estimate_cases.py``), both recording
the
same run: the tracker's peak (``planning/capture/tracker.py``) and the peak of the allocator's malloc/free events that
``torch.profiler`` records with ``profile_memory=True`` (exact in one process: every free happens on this thread).

    python bench/tracker_allocator.py                                     # FSDP2 and the plain model, 2 steps
    python bench/tracker_allocator.py --set memory.mst=true               # one run with these overrides

The allocator also sees scratch an op allocates and frees inside itself, which the tracker does not: its peak may
be higher by that, never lower. Output: one JSON object on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

RUNS = {"plain": [], "fsdp2": ["parallel.use_torch_fsdp2=true"]}


def allocator_peak(prof) -> int:
    """The largest sum of the allocator's malloc (+) and free (-) events, in time order."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def one_run(overrides: list, steps: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.planning.capture.tracker import DispatchTracer
    from megatron_lc.training.loop import Trainer
    from tests.support import estimate_cases

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"),
                          estimate_cases.base_overrides(tmp) + list(overrides))
        cfg.train.train_iters = steps
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, DispatchTracer() as tracker:
            Trainer(cfg, Topology(), torch.device("cpu")).train()
    t, a = tracker.peak().bytes, allocator_peak(prof)
    return {"overrides": overrides, "tracker_bytes": t, "allocator_bytes": a, "allocator_minus_tracker": a - t}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", dest="overrides", action="append", default=None, metavar="SECTION.KEY=VALUE")
    p.add_argument("--steps", type=int, default=2)
    a = p.parse_args(argv)
    runs = {"custom": a.overrides} if a.overrides else RUNS
    return {"bench": "tracker_allocator", "steps": a.steps,
            "runs": {name: one_run(ov, a.steps) for name, ov in runs.items()}}


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
