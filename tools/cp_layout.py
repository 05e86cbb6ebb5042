"""Which tokens each cp rank holds, the k/v it receives and the attention work it runs, for a config and a
micro-batch's documents -- computed by the functions the trainer calls (``parallel/token_layout.py``,
``parallel/cp_balance.py``, ``attention/kv_plan.py``).

    python tools/cp_layout.py --config configs/llama3_8b_1m.yaml --documents lengths.json
    python tools/cp_layout.py --config configs/llama3_8b_1m.yaml --mean-document-length 65536 --sample 0
    python tools/cp_layout.py --config configs/llama3_8b_1m.yaml --mean-document-length 65536 \\
        --set parallel.cp_layout=zigzag                                      # the zigzag ring, for comparison

Prints one JSON object ``{"ranks": [{"tokens": [[g0, g1], ...], "kv_received_bytes_per_layer": B, "pairs": P},
...], "summary": {...}}``: per cp rank in cp-rank order its global token ranges in local order, the k/v bytes its
ring attention receives in one layer's forward (in the compute dtype; 0 without a ring) and the (query, key)
pairs its attention runs for each of its heads; both are the mean over the layers' windows. The summary gives the
slowest / mean rank of both.

Documents: ``--documents F.json``, a JSON list of document lengths summing to ``data.seq_length`` (one row, used for
every row of the micro-batch) or a list of such lists (one per row); or the mock data's sample ``--sample K`` (the
trainer's with ``data.mock_data``: ``data.mean_document_length`` -- or ``--mean-document-length N`` -- and
``train.seed``), the documents of the micro-batch a run or a rehearsal of the config trains on first; neither: one
causal sequence a row. ``--gpus``: the world size (default: tp x cp, one data-parallel replica). Exit 0, or 2 with
a one-line error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config.cli import add_config_arguments  # noqa: E402  (after the path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p, "before laying out")
    p.add_argument("--documents", default=None, metavar="LENGTHS.json",
                   help="document lengths summing to data.seq_length (a list, or a list per row)")
    p.add_argument("--mean-document-length", type=int, default=None, metavar="N",
                   help="mock documents of this length-weighted mean (sets data.mean_document_length)")
    p.add_argument("--sample", type=int, default=0, metavar="K", help="the mock data's sample K (default: 0)")
    p.add_argument("--gpus", type=int, default=None, help="world size (default: tp x cp)")
    return p.parse_args(argv)


def documents_of(args, cfg, rows: int):
    """The micro-batch's ``DocumentRanges`` (module doc), or None for one causal sequence a row."""
    from megatron_lc.config import ConfigError
    from megatron_lc.config.documents import DocumentRanges
    from megatron_lc.data.dataset import MockDataset

    s = cfg.data.seq_length
    if args.documents is not None:
        try:
            with open(args.documents) as f:
                lengths = json.load(f)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--documents {args.documents}: {e}") from None
        per_row = lengths if lengths and isinstance(lengths[0], list) else [lengths] * rows
        cu = []
        for row in per_row:
            if sum(row) != s or any(not isinstance(n, int) or n < 1 for n in row):
                raise ConfigError(f"--documents {args.documents}: lengths must be positive integers summing to "
                                  f"data.seq_length ({s}); a row sums to {sum(row)}")
            cu.append((0, *np.cumsum(row).tolist()))
        if len(cu) != rows:
            raise ConfigError(f"--documents {args.documents}: {len(cu)} rows for train.micro_batch_size {rows}")
        return DocumentRanges(tuple(cu))
    if cfg.data.mean_document_length is None:
        return None
    data = MockDataset(s, cfg.model.vocab_size, cfg.train.seed, 0, cfg.data.mean_document_length)
    ids = range(args.sample * rows, (args.sample + 1) * rows)
    return DocumentRanges.from_eod(np.stack([data[k][:-1] for k in ids]), data.eod)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_lc.attention.kv_plan import cp_rank_figures
    from megatron_lc.config import ConfigError, load_config, resolve_execution, resolve_layout

    try:
        over = list(args.overrides)
        if args.mean_document_length is not None:
            over.append(f"data.mean_document_length={args.mean_document_length}")
        cfg = load_config(args.config, over)
        p = cfg.parallel
        layout = resolve_layout(cfg, args.gpus or p.tensor_model_parallel_size * p.context_parallel_size)
        docs = documents_of(args, cfg, layout.micro_batch_size)
        dtype = resolve_execution(cfg, torch.device("cuda" if cfg.train.device == "cuda" else "cpu")).compute_dtype
        ranks = cp_rank_figures(layout, docs, cfg.model.kv_channels, dtype.itemsize)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pairs = np.array([r["pairs"] for r in ranks], dtype=np.float64)
    recv = np.array([r["kv_received_bytes_per_layer"] for r in ranks], dtype=np.float64)
    summary = {"cp_layout": layout.cp_layout, "cp_comm_type": layout.cp_comm_type,
               "pairs_slowest_over_mean": round(float(pairs.max() / pairs.mean()), 4),
               "kv_received_bytes_max_over_mean": round(float(recv.max() / recv.mean()), 4) if recv.any() else None}
    print(json.dumps({"ranks": ranks, "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
