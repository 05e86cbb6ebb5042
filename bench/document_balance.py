"""Ring attention under packed documents, zigzag vs the balanced layout, side by side in one run: how far the
slowest cp rank's attention work is from the mean, and how many k/v bytes each layout moves against what the
ranks' queries need.

    python bench/document_balance.py [--seeds 8] [--cases 1m-64k 8m-64k ...]    # JSON on stdout

Each case is a sequence, a ring size and mock documents (``estimate/ring_balance.mock_documents``, the mock data's
lognormal lengths of the given length-weighted mean, the sample starting inside a document: what the estimator
lays out; ``long-tail``: one 512K document at a random
place among documents of 1K-4K tokens), ``--seeds`` samples each. For both layouts (``parallel/cp_balance.py``:
``zigzag_spans``, ``balanced_spans``) and every rank, with the functions the trainer calls:

* ``pairs``: the (query, key) pairs its attention runs (``rank_work``; the rectangles run exactly these);
* ``received``: the k/v rows it receives in one layer's forward -- the zigzag ring passes every rank's k/v to every
  other ((R-1) x s/R rows), the balanced layout only the rows of ``attention/kv_plan.KvPlan``;
* ``needed``: the rows it does not hold that some query of it sees (the plan's rows for that layout).

Printed per case: slowest / mean rank pairs (mean and worst over seeds), received / needed bytes (the sum over
ranks), the slowest rank's received rows in units of a rank's share (s/R), and the balanced layout's bytes as a
fraction of the ring's. Goal (causal documents, no window): slowest / mean <= 1.05 and received / needed <= 1.10.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.attention.kv_plan import kv_plan  # noqa: E402
from megatron_lc.config.documents import DocumentRanges  # noqa: E402
from megatron_lc.estimate.ring_balance import mock_documents  # noqa: E402
from megatron_lc.parallel.cp_balance import balanced_spans, rank_work, zigzag_spans  # noqa: E402

M, K = 1 << 20, 1 << 10
CASES = {  # name: (sequence, ring size, length-weighted mean document length, or "long-tail")
    "1m-64k": (M, 8, 64 * K), "1m-16k": (M, 8, 16 * K), "1m-2k": (M, 8, 2 * K), "4m-64k": (4 * M, 8, 64 * K),
    "8m-64k": (8 * M, 32, 64 * K), "long-tail": (M, 8, "long-tail"),
}


def documents(s: int, mean, seed: int) -> DocumentRanges:
    """One sample's documents (module doc)."""
    if mean != "long-tail":
        return mock_documents(s, mean, seed)  # what the estimator lays out
    rng = np.random.default_rng([seed, s])
    lengths = list(rng.integers(K, 4 * K + 1, s // (2 * K)))
    at = int(rng.integers(0, len(lengths)))
    lengths = lengths[:at] + [512 * K] + lengths[at:]
    ends = np.cumsum(lengths)
    return DocumentRanges(((0, *(int(e) for e in ends[ends < s]), s),))


def layout_figures(docs: DocumentRanges, s: int, R: int, spans, ring: bool) -> dict:
    pairs = np.array(rank_work(docs, s, spans, None), dtype=np.float64)
    plan = kv_plan(docs, None, spans, s)
    needed = np.array([plan.received_rows(r) for r in range(R)], dtype=np.float64)
    received = np.full(R, (R - 1) * s // R, dtype=np.float64) if ring else needed
    return {"pairs_max_over_mean": pairs.max() / pairs.mean(), "received_over_needed": received.sum() / needed.sum(),
            "slowest_received_shares": received.max() / (s // R), "received": received.sum()}


def run_case(s: int, R: int, mean, seeds: int) -> dict:
    rows = {"zigzag": [], "balanced": []}
    t0 = time.perf_counter()
    for seed in range(seeds):
        docs = documents(s, mean, seed)
        rows["zigzag"].append(layout_figures(docs, s, R, zigzag_spans(s, R), ring=True))
        rows["balanced"].append(layout_figures(docs, s, R, balanced_spans(docs, s, R, None), ring=False))
    out = {"seq": s, "cp": R, "mean_document_length": mean, "seeds": seeds,
           "solver_and_plan_seconds_per_sample": round((time.perf_counter() - t0) / seeds / 2, 3)}
    for name, rs in rows.items():
        pm = [r["pairs_max_over_mean"] for r in rs]
        out[name] = {"pairs_max_over_mean": round(float(np.mean(pm)), 4), "pairs_max_over_mean_worst": round(max(pm), 4),
                     "received_over_needed": round(float(np.mean([r["received_over_needed"] for r in rs])), 4),
                     "slowest_received_shares": round(float(np.mean([r["slowest_received_shares"] for r in rs])), 3)}
    out["balanced_bytes_over_zigzag"] = round(float(np.mean([b["received"] / z["received"] for b, z in
                                                             zip(rows["balanced"], rows["zigzag"])])), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    args = ap.parse_args()
    out = {"cases": {name: run_case(*CASES[name], args.seeds) for name in args.cases}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
