"""Picture of a plan: every tensor a rectangle in (time x address) space, peak and lower bound marked.

    plot_plan(trace, plan, "plan.png")

Colours: layer-block transients (by layer, forward blue / backward orange shades), other tensors grey. Uses
matplotlib's Agg backend (no display needed)."""
from __future__ import annotations

from typing import Optional

from .plan import Plan
from .trace import Trace


def plot_plan(trace: Trace, plan: Plan, path: str, title: Optional[str] = None) -> None:
    """Draw ``plan`` over ``trace`` into ``path`` (png/pdf/svg by extension)."""
    # matplotlib is optional (the ``planning`` extra) and only this drawing needs it
    import matplotlib
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    matplotlib.use("Agg")

    mark = {}
    for e in trace.events:
        if e.op == "malloc":
            mark[e.id] = (e.layer, e.phase)
    layers = sorted({m[0] for m in mark.values() if m[0] is not None}) or [0]
    fwd, bwd = plt.get_cmap("Blues"), plt.get_cmap("Oranges")
    scale = 1 << 20
    rects, colors = [], []
    for r in trace.requests():
        size = plan.sizes.get(r.id, r.size)
        if not size:
            continue
        layer, phase = mark[r.id]
        rects.append(Rectangle((r.start, plan.offsets[r.id] / scale), r.end - r.start, size / scale))
        if layer is None:
            colors.append((0.6, 0.6, 0.6, 0.8))
        else:
            shade = 0.35 + 0.5 * (layers.index(layer) / max(len(layers) - 1, 1))
            colors.append((fwd if phase == "fwd" else bwd)(shade))
    fig, ax = plt.subplots(figsize=(12, 6))
    ax.add_collection(PatchCollection(rects, facecolors=colors, edgecolors=(0, 0, 0, 0.25), linewidths=0.2))
    ax.axhline(plan.peak_bytes / scale, color="red", lw=1, label=f"plan peak {plan.peak_bytes / scale:.2f} MiB")
    ax.axhline(plan.lower_bound_bytes / scale, color="green", lw=1, ls="--",
               label=f"max-live lower bound {plan.lower_bound_bytes / scale:.2f} MiB")
    ax.set_xlim(0, max(len(trace.events), 1))
    ax.set_ylim(0, max(plan.peak_bytes, 1) / scale * 1.05)
    ax.set_xlabel("time (trace event)")
    ax.set_ylabel("address (MiB)")
    ax.set_title(title or f"{len(rects)} tensors, status {plan.status}, solver {plan.solver}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
