"""Document lengths of ``.bin/.idx`` corpora: a histogram (text, and a PNG with ``--png``) and the length-weighted
mean length, the value ``data.mean_document_length`` takes for the estimator's attention FLOPs under document masks.

    python tools/data_stats.py data/web data/books [--seq-length 131072] [--png lengths.png] [--json stats.json]

Per prefix and for all of them together: documents, tokens, mean / median / 90th percentile / longest length,
the share of tokens in documents of at least 1K, 4K, 32K, 128K, 1M tokens, and

* ``length_weighted_mean``: sum(len^2) / sum(len), the length of the document a random token sits in;
* with ``--seq-length S``, ``length_weighted_mean_at_seq_length``: sum(len x min(len, S)) / sum(len), the same with
  documents cut into samples of S tokens (what a token can attend to at most) -- the number to set as
  ``data.mean_document_length`` for a run at that sequence length.

Lengths are the documents' tokens as stored (``tools/preprocess_data.py --append-eod`` counts the end-of-document
id; files written without it read one token longer in training). Histogram bins: powers of 2. Exit 0, or 2 with a
one-line error for a missing or broken prefix.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lc.data import DataError  # noqa: E402
from megatron_lc.data.indexed import document_lengths  # noqa: E402

SHARE_AT = (1024, 4096, 32768, 131072, 1048576)


def length_stats(lengths: np.ndarray, seq_length: int | None = None) -> dict:
    """Summary of document ``lengths``. Example: lengths 1, 3 -> length-weighted mean (1 + 9) / 4 = 2.5; at
    ``seq_length`` 2: (1 x 1 + 3 x 2) / 4 = 1.75.

    >>> s = length_stats(np.array([1, 3]), seq_length=2)
    >>> s["length_weighted_mean"], s["length_weighted_mean_at_seq_length"]
    (2.5, 1.75)
    """
    n = lengths.astype(np.float64)
    total = float(n.sum())
    out = {"documents": int(len(n)), "tokens": int(total), "mean": round(float(n.mean()), 1),
           "median": float(np.median(n)), "p90": float(np.percentile(n, 90)), "max": int(n.max()),
           "length_weighted_mean": round(float((n * n).sum() / total), 1),
           "token_share_in_documents_of_at_least": {str(k): round(float(n[n >= k].sum() / total), 4)
                                                    for k in SHARE_AT}}
    if seq_length is not None:
        out["seq_length"] = seq_length
        out["length_weighted_mean_at_seq_length"] = round(float((n * np.minimum(n, seq_length)).sum() / total), 1)
    return out


def histogram(lengths: np.ndarray) -> list[dict]:
    """Documents and tokens per power-of-2 length bin ``[2^i, 2^(i+1))``, from the shortest to the longest."""
    bins = np.floor(np.log2(np.maximum(lengths, 1))).astype(int)
    out = []
    for b in range(int(bins.min()), int(bins.max()) + 1):
        sel = lengths[bins == b]
        out.append({"from": 2 ** b, "to": 2 ** (b + 1), "documents": int(len(sel)), "tokens": int(sel.sum())})
    return out


def text_report(name: str, stats: dict, hist: list[dict], width: int = 40) -> str:
    lines = [f"{name}: {stats['documents']} documents, {stats['tokens']} tokens; mean {stats['mean']}, median "
             f"{stats['median']:g}, p90 {stats['p90']:g}, longest {stats['max']}",
             f"  length-weighted mean (data.mean_document_length): {stats['length_weighted_mean']}"]
    if "length_weighted_mean_at_seq_length" in stats:
        lines.append(f"  ... at seq_length {stats['seq_length']}: {stats['length_weighted_mean_at_seq_length']}")
    top = max(h["tokens"] for h in hist) or 1
    lines.append("  length bin            documents      tokens  share of tokens")
    for h in hist:
        bar = "#" * round(width * h["tokens"] / top)
        lines.append(f"  [{h['from']:>8}, {h['to']:>8})  {h['documents']:>9}  {h['tokens']:>10}  "
                     f"{h['tokens'] / max(stats['tokens'], 1):6.1%} {bar}")
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    # matplotlib is an optional dependency (the plot extra): imported only when a figure is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, r in results.items():
        hist = r["histogram"]
        ax.step([h["from"] for h in hist] + [hist[-1]["to"]], [h["tokens"] / r["stats"]["tokens"] for h in hist]
                + [0.0], where="post", label=f"{name} (length-weighted mean {r['stats']['length_weighted_mean']:g})")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("document length (tokens)")
    ax.set_ylabel("share of tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prefixes", nargs="+", metavar="PREFIX", help=".bin/.idx prefixes")
    p.add_argument("--seq-length", type=int, default=None, help="also the length-weighted mean at this length")
    p.add_argument("--png", default=None, help="histogram figure (needs matplotlib)")
    p.add_argument("--json", default=None, help="write the numbers as JSON")
    a = p.parse_args(argv)
    try:
        if a.png and importlib.util.find_spec("matplotlib") is None:
            raise DataError("--png needs matplotlib, which is not installed (pip install 'megatron_lc[plot]')")
        if a.seq_length is not None and a.seq_length < 1:
            raise DataError(f"--seq-length ({a.seq_length}) must be >= 1")
        lengths = {prefix: document_lengths(prefix) for prefix in a.prefixes}
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    groups = dict(lengths)
    if len(lengths) > 1:
        groups["all"] = np.concatenate(list(lengths.values()))
    results = {name: {"stats": length_stats(n, a.seq_length), "histogram": histogram(n)} for name, n in groups.items()}
    print("\n\n".join(text_report(name, r["stats"], r["histogram"]) for name, r in results.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if a.png:
        plot(results, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
