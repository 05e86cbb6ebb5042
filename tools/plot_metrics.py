"""Plot a run's ``metrics.jsonl`` (one JSON object per step, written by rank 0): loss, tokens/s, MFU and peak memory
over steps, one PNG.

    python tools/plot_metrics.py runs/tiny_cpu/metrics.jsonl                 # writes runs/tiny_cpu/metrics.png
    python tools/plot_metrics.py runs/tiny_cpu/metrics.jsonl -o docs/images/tiny_cpu_metrics.png
    python tools/plot_metrics.py a/metrics.jsonl b/metrics.jsonl --label dp2 --label tp2 -o compare.png

Without ``-o`` the PNG goes beside the (first) metrics file, named after it (``metrics.jsonl`` -> ``metrics.png``);
the path written is printed.

A resumed run appends to the same file, after a ``{"resumed_from": ..., "step": N}`` record: steps between the last
checkpoint and the interruption appear twice; the later record of each step (the one the resumed run kept) is
plotted, and every resume point is a dotted vertical line. Skipped (non-finite) steps are marked with a red x on
the loss axis; steps without an MFU (the peak was wrong for the machine) leave a gap. Validation records
(``{"eval": "valid", "step": N, "loss": ...}``, ``train.eval_interval``) are drawn on the loss axis as circles joined
by a dashed line, the test split's (``train.test_at_end``) as a square.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys

PANELS = [  # (record key, axis label, scale)
    ("loss", "loss", 1.0),
    ("tokens_per_s", "tokens / s", 1.0),
    ("mfu", "MFU (%)", 100.0),
    ("peak_memory_bytes", "peak memory (GiB)", 1.0 / 2**30),
]


def _records(path: str) -> list[dict]:
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    out = []
    for n, line in enumerate(lines, 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):  # the last line of a killed run may be cut short
                continue
            raise ValueError(f"{path}: record {n} is not a JSON line") from None
    return out


def read_metrics(path: str) -> list[dict]:
    """Step records of ``path`` ordered by step, the last record of a repeated step kept."""
    by_step: dict[int, dict] = {}
    for rec in _records(path):
        if "resumed_from" not in rec and "eval" not in rec:
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def read_evals(path: str) -> dict[str, list[dict]]:
    """Validation / test records of ``path`` by split, ordered by step (the last of a repeated step kept)."""
    out: dict[str, dict[int, dict]] = {}
    for rec in _records(path):
        if "eval" in rec:
            out.setdefault(rec["eval"], {})[int(rec["step"])] = rec
    return {split: [recs[s] for s in sorted(recs)] for split, recs in out.items()}


def resume_points(path: str) -> list[int]:
    """The iterations a run of ``path`` was resumed at."""
    return [int(r["step"]) for r in _records(path) if "resumed_from" in r]


def moving_average(values: list[float], n: int) -> list[float]:
    out, window = [], []
    for v in values:
        window = (window + [v])[-n:]
        finite = [x for x in window if math.isfinite(x)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def plot(runs: list[tuple[str, list[dict]]], out: str, title: str | None = None, smooth: int = 1,
         resumes: list[int] = (), evals: list[dict] = ()) -> None:
    """``evals``: per run, ``read_evals``' records (drawn on the loss axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    for (key, label, scale), ax in zip(PANELS, axes.flat):
        for ri, (name, recs) in enumerate(runs):
            steps = [r["step"] for r in recs if r.get(key) is not None]
            vals = [float(r[key]) * scale for r in recs if r.get(key) is not None]
            if key == "loss" and smooth > 1:
                ax.plot(steps, vals, alpha=0.25, lw=0.8)
                ax.plot(steps, moving_average(vals, smooth), label=f"{name} (mean of {smooth})", lw=1.4,
                        color=ax.lines[-1].get_color())
            else:
                ax.plot(steps, vals, label=name, lw=1.2)
            if key == "loss":
                color = ax.lines[-1].get_color()
                run_evals = evals[ri] if evals else {}
                for split, marker, style in (("valid", "o", "--"), ("test", "s", "")):
                    pts = run_evals.get(split, [])
                    if pts:
                        ax.plot([p["step"] for p in pts], [p["loss"] for p in pts], marker=marker, ls=style or "none",
                                color=color, ms=5, lw=1.0, label=f"{name} {split}")
                bad = [r["step"] for r in recs if r.get("skipped")]
                if bad:
                    finite = [v for v in vals if math.isfinite(v)] or [0.0]
                    ax.plot(bad, [max(finite)] * len(bad), "rx", label="skipped (non-finite)")
        for i, step in enumerate(sorted(set(resumes))):
            ax.axvline(step, ls=":", color="gray", lw=1, label="resumed" if i == 0 else None)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(runs) > 1 or any(lb in ("resumed", "skipped (non-finite)") or lb.endswith((" valid", " test"))
                            for lb in labels):
        axes[0][0].legend(fontsize=8)
    fig.suptitle(title or ", ".join(name for name, _ in runs))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def default_output(metrics: str) -> str:
    """The PNG beside a metrics file: ``runs/x/metrics.jsonl`` -> ``runs/x/metrics.png``."""
    root, ext = os.path.splitext(metrics)
    return (root if ext == ".jsonl" else metrics) + ".png"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", help="metrics.jsonl file(s)")
    p.add_argument("-o", "--output", default=None,
                   help="PNG to write (default: beside the first metrics file, e.g. runs/x/metrics.png)")
    p.add_argument("--label", action="append", default=[], help="legend name per file (default: its directory)")
    p.add_argument("--title")
    p.add_argument("--smooth", type=int, default=1, help="moving average window for the loss")
    a = p.parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print("error: plotting needs matplotlib, which is not installed (pip install 'megatron_lc[plot]')",
              file=sys.stderr)
        return 2
    runs, resumes, evals = [], [], []
    for i, path in enumerate(a.metrics):
        if not os.path.isfile(path):
            print(f"error: {path} not found", file=sys.stderr)
            return 2
        recs = read_metrics(path)
        if not recs:
            print(f"error: {path} has no records", file=sys.stderr)
            return 2
        name = a.label[i] if i < len(a.label) else os.path.basename(os.path.dirname(os.path.abspath(path)))
        runs.append((name, recs))
        evals.append(read_evals(path))
        resumes += resume_points(path)
    out = a.output or default_output(a.metrics[0])
    plot(runs, out, a.title, a.smooth, resumes, evals)
    print(f"wrote {out} ({sum(len(r) for _, r in runs)} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
