"""The ranks' figures beside the estimator's for the same layout: the JSON a rehearsal writes, its summary line
and its picture. The summary line (one line, wrapped here)::

    rehearsal: 2 ranks, max peak device 45.91 GiB (estimator 45.71 GiB allocated, +0.4%; 48.58 GiB with its
    fragmentation reserve), max host 142.96 GiB, 0 violations; ran: 2 steps, validation, save, async save, resume,
    resumed step

The device peak is the training steps' (what the estimator's peak models); the job's other parts have a line each
before it (``phase_lines``), and the line's end names a job peak above the steps' and ranks that stopped at an op
CUDA would refuse. ``--steps-only`` ends it with ``ran: 2 steps only``.

One step (``--steps 1``) never reaches the estimator's peak, a steady-state step that holds AdamW's states (they
are made by the first optimizer step, after the first step's backward): its peak is set beside the estimator's first
step instead, and the steady-state figure after it::

    rehearsal: 1 ranks, max peak device 38.43 GiB (estimator 38.23 GiB allocated in step 1, before AdamW's states,
    +0.5%; 45.71 GiB from step 2 on, 48.58 GiB with its fragmentation reserve), max host 131.73 GiB, 0 violations;
    ran: 1 steps only
"""
from __future__ import annotations

import copy

import torch

from ..attention.cp_bytes import cp_attention_bytes
from ..attention.kv_plan import cp_rank_figures
from ..config import Config, resolve_execution, resolve_layout
from ..config.moe import EXPERT_LOAD
from ..data import build_dataset, make_batch, microbatch_sample_ids
from ..estimate import Dims, estimate
from ..estimate.moe import all_to_all_bytes, remade_in_backward
from ..parallel.expert_parallel import TAG as EXPERTS_TAG
from ..parallel.topology import Topology
from ..units import GIB
from .moments import phase


def summarize(cfg: Config, hw, world: int, ranks: dict, steps: int = 2) -> dict:
    """``ranks``: {rank: figures} of ``steps`` steps each. The estimator's peak is this layout's ``estimate`` on ``hw``
    without its fragmentation reserve (``allocated_peak``): a rehearsal counts live tensors, as
    ``torch.cuda.max_memory_allocated`` does, so that is the like-for-like figure; the reserve is kept beside it
    (``estimator_reserve_bytes``) and ``fits_with_reserve`` adds it to the rehearsed peak. That peak is a
    steady-state step's, with AdamW's states; the first step's (``first_step_peak``: none before its optimizer step)
    is ``estimator_first_step_peak_bytes``, what a rehearsal of one step compares with (``difference_first_step``)."""
    est = estimate(cfg, hw, world)
    allocated, first = est.memory.allocated_peak, est.memory.first_step_peak
    peak = max(r["device"]["step_peak_bytes"] for r in ranks.values())  # the steps' (what the estimator models)
    whole = max(r["device"]["peak_bytes"] for r in ranks.values())  # the job's, the job's phases included
    host = max(r["host"]["peak_bytes"] for r in ranks.values())
    at = max(ranks, key=lambda k: ranks[k]["device"]["step_peak_bytes"])
    return {"ranks": len(ranks), "world": world, "max_peak_device_bytes": peak, "max_peak_rank": at,
            "max_peak_moment": ranks[at]["device"]["step_peak_moment"], "max_job_peak_device_bytes": whole,
            "max_setup_peak_bytes": max(r["device"]["setup_peak_bytes"] for r in ranks.values()),
            "estimator_peak_bytes": allocated, "estimator_reserved_peak_bytes": est.memory.peak,
            "estimator_reserve_bytes": est.memory.fragmentation, "estimator_peak_phase": est.memory.peak_phase,
            "estimator_phases": est.memory.phases, "estimator_parts": est.memory.parts,
            "estimator_host_per_rank_bytes": est.memory.host_per_rank,
            "difference": (peak - allocated) / allocated if allocated else None,
            "steps": steps, "estimator_optimizer_states_bytes": est.memory.optimizer_states,
            "estimator_first_step_peak_bytes": first,
            "difference_first_step": (peak - first) / first if first else None,
            "max_host_bytes": host, "device_capacity_bytes": hw.device_bytes, "fits": whole <= hw.device_bytes,
            "fits_with_reserve": whole + est.memory.fragmentation <= hw.device_bytes,
            "violations": sum(len(r.get("violations", [])) for r in ranks.values()),
            "stopped": {k: r["stopped"] for k, r in ranks.items() if r.get("stopped")},
            "phases": phase_figures(ranks, est.memory), "job": next(iter(ranks.values())).get("job", []),
            "layer0_attention_bytes": attention_bytes(cfg, world, ranks),
            "attention_balance": attention_balance(cfg, world, ranks, steps),
            "expert_all_to_all_bytes": expert_bytes(cfg, world, ranks)}


PERSISTENT = ("parameters", "gradients", "optimizer states (+ master weights)", "autocast bf16 weight copies",
              "rounding buffers (Memo)")  # the estimator's parts that outlive a step's activations


def phase_figures(ranks: dict, memory) -> dict:
    """Each part of the job (``figures.rank_figures``' ``phases``): the largest device and host peak over the ranks,
    with its rank and moment, and beside it the estimator's figure where one is like for like -- ``setup`` its
    setup moment, ``steps`` and ``resumed step`` its steady-state peak (``resumed step`` holds the loaded AdamW
    states) -- or, for the checkpoint phases (the estimator has no save moment), its persistent parts: parameters,
    gradients, optimizer states and the techniques' buffers, what a step leaves on the device."""
    beside = {"setup": ("setup moment", memory.phases.get("setup")),
              "steps": ("peak", memory.allocated_peak), "resumed step": ("peak", memory.allocated_peak)}
    persistent = ("persistent parts", sum(memory.parts.get(k, 0.0) for k in PERSISTENT))
    out = {}
    for name in next(iter(ranks.values())).get("phases", {}):
        per = {k: r["phases"][name] for k, r in ranks.items() if name in r.get("phases", {})}
        rank = max(per, key=lambda k: per[k]["device_peak_bytes"])
        device = per[rank]["device_peak_bytes"]
        what, est = beside.get(name, persistent if name in ("save", "async save", "resume") else (None, None))
        out[name] = {"device_peak_bytes": device, "rank": rank, "moment": per[rank]["device_peak_moment"],
                     "host_peak_bytes": max(p["host_peak_bytes"] for p in per.values()),
                     "estimator": what, "estimator_bytes": est,
                     "difference": (device - est) / est if est else None}
    return out


def phase_lines(s: dict) -> list:
    """One line per part of the job, e.g. ``phase async save: device 20.31 GiB (rank 0, async save), host 142.07
    GiB; estimator's persistent parts 24.55 GiB``."""
    out = []
    for name, p in s["phases"].items():
        line = (f"phase {name}: device {p['device_peak_bytes'] / GIB:.2f} GiB (rank {p['rank']}, {p['moment']}), "
                f"host {p['host_peak_bytes'] / GIB:.2f} GiB")
        if p["estimator_bytes"]:
            line += (f"; estimator's {p['estimator']} {p['estimator_bytes'] / GIB:.2f} GiB "
                     f"({100 * p['difference']:+.1f}%)")
        out.append(line)
    return out


def attention_bytes(cfg: Config, world: int, ranks: dict) -> dict:
    """Bytes one rank sent in layer 0's context-parallel attention in the last step, rehearsed (the largest over
    the ranks) beside the formula of ``attention/cp_bytes.py`` (ring, Ulysses, hybrid; None otherwise)."""
    layout = resolve_layout(cfg, world)
    if layout.cp == 1 or layout.cp_comm_type not in ("p2p", "a2a", "a2a+p2p"):
        return {}
    m = cfg.model
    elem = resolve_execution(cfg, torch.device("cuda")).compute_dtype.itemsize
    formula = cp_attention_bytes(layout.cp_comm_type, cfg.data.seq_length, layout.micro_batch_size, layout.heads,
                                 layout.kv_heads, m.kv_channels, layout.cp, layout.ulysses, elem)
    formula = {k: v * layout.num_micro_batches for k, v in formula.items()}
    seen = {}
    for r in ranks.values():
        for key, n in r["comm_bytes_per_step"].items():
            tag, op = key.split("/", 1)
            if tag == "layer0.attn":
                phase = "bwd" if op.endswith("bwd") else "fwd"
                seen[phase] = max(seen.get(phase, 0), n)
    return {"rehearsed": seen, "formula": formula}


def attention_balance(cfg: Config, world: int, ranks: dict, steps: int) -> dict:
    """Per rehearsed rank, one layer's attention in the last step: the (query, key) pairs it ran and the k/v bytes
    its ring attention received in forward (the step's counts over layers x micro-batches), beside what
    ``tools/cp_layout.py`` prints for the same micro-batches (``kv_plan.cp_rank_figures``: the mean over them), and
    the slowest / mean rank of both over the rehearsed ranks (``{}`` for a rehearsal that counted none, and for a
    layout without a ring: Ulysses and FPDT split heads, every rank runs the same pairs)."""
    layout = resolve_layout(cfg, world)
    if layout.ring == 1 or not all("attention" in r for r in ranks.values()):
        return {}
    elem = resolve_execution(cfg, torch.device("cuda")).compute_dtype.itemsize
    cfg = copy.deepcopy(cfg)
    cfg.data.mock_data = True  # the rehearsal's data (rank.rehearsal_config)
    gbs, mbs, n = layout.global_batch_size, layout.micro_batch_size, layout.num_micro_batches
    data = build_dataset(cfg, [steps * gbs, 0, 0]).train
    per, printed = {}, {}
    for k, r in ranks.items():
        topo = Topology(world_size=world, rank=k, tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, dp=layout.dp)
        if topo.dp_rank not in printed:  # the layout command's figures of this dp rank's micro-batches, averaged
            figs = [cp_rank_figures(layout, make_batch(data, [(steps - 1) * gbs + i for i in microbatch_sample_ids(
                m, gbs, mbs, layout.dp, topo.dp_rank)], cfg.data).get("documents"), cfg.model.kv_channels, elem)
                for m in range(n)]
            printed[topo.dp_rank] = [{key: sum(f[c][key] for f in figs) / n for key in
                                      ("pairs", "kv_received_bytes_per_layer")} for c in range(layout.cp)]
        calls = cfg.model.num_layers * n
        a = r["attention"]
        per[k] = {"pairs": a["pairs_per_step"] / calls,
                  "kv_received_bytes_per_layer": a["kv_received_bytes_per_step"]["p2p_fwd"] / calls,
                  "layout_command": printed[topo.dp_rank][topo.cp_rank]}
    out = {"ranks": per}
    for key in ("pairs", "kv_received_bytes_per_layer"):
        vals = [p[key] for p in per.values()]
        mean = sum(vals) / len(vals)
        out[f"{key}_slowest_over_mean"] = max(vals) / mean if mean else None
        want = [p["layout_command"][key] for p in per.values()]
        out[f"{key}_difference"] = max((abs(v - w) / w for v, w in zip(vals, want) if w), default=0.0)
    return out


def attention_line(s: dict) -> str:
    """``attention (layer mean, last step): pairs slowest/mean 1.000, kv received slowest/mean 1.76; beside
    tools/cp_layout.py: pairs +0.0%, kv received +0.0%`` (over the rehearsed ranks)."""
    a = s.get("attention_balance") or {}
    if not a:
        return ""
    fmt = (lambda v: "-" if v is None else f"{v:.3f}")
    return (f"attention (layer mean, last step, rehearsed ranks {', '.join(map(str, a['ranks']))}): pairs "
            f"slowest/mean {fmt(a['pairs_slowest_over_mean'])}, kv received slowest/mean "
            f"{fmt(a['kv_received_bytes_per_layer_slowest_over_mean'])}; largest difference from tools/cp_layout.py: "
            f"pairs {100 * a['pairs_difference']:.1f}%, kv received {100 * a['kv_received_bytes_per_layer_difference']:.1f}%")


def expert_bytes(cfg: Config, world: int, ranks: dict) -> dict:
    """Bytes one rank sent in the experts' all-to-alls of the last step (every MoE layer; the largest over the
    ranks; ``fwd`` with the forward exchanges MsT's chunks run again in backward), beside the estimator's
    (``estimate/moe.all_to_all_bytes`` at the stated load, each way), and the load the exchange assumed (a rehearsal has no router values: ``config.moe.EXPERT_LOAD`` on every rank, as the
    busiest); empty without expert parallelism."""
    layout = resolve_layout(cfg, world)
    if layout.ep == 1:
        return {}
    dims = Dims.from_config(cfg, layout, "cuda")
    per_step = sum(dims.moe_layers) * layout.num_micro_batches * all_to_all_bytes(dims)
    remade = per_step if remade_in_backward(cfg, dims) else 0.0  # MsT's chunks exchange again in backward
    seen = {}
    for r in ranks.values():
        for key, n in r["comm_bytes_per_step"].items():
            tag, _ = key.split("/", 1)
            if tag.startswith(EXPERTS_TAG + "."):
                phase = tag.rsplit(".", 1)[1]
                seen[phase] = max(seen.get(phase, 0), n)
    return {"rehearsed": seen, "formula": {"fwd": per_step + remade, "bwd": per_step}, "load": EXPERT_LOAD}


def summary_line(s: dict) -> str:
    """The last line (module doc): the estimator's allocated peak beside the rehearsed one -- its first step's after
    one step -- and, when it has one, the peak with its fragmentation reserve."""
    est = s["estimator_peak_bytes"] / GIB
    if s["steps"] < 2:
        versus = (f"estimator {s['estimator_first_step_peak_bytes'] / GIB:.2f} GiB allocated in step 1, before "
                  f"AdamW's states, {100 * s['difference_first_step']:+.1f}%; {est:.2f} GiB from step 2 on")
        sep = ", "
    else:
        versus, sep = f"estimator {est:.2f} GiB allocated, {100 * s['difference']:+.1f}%", "; "
    if s["estimator_reserve_bytes"]:
        versus += f"{sep}{s['estimator_reserved_peak_bytes'] / GIB:.2f} GiB with its fragmentation reserve"
    line = (f"rehearsal: {s['ranks']} ranks, max peak device {s['max_peak_device_bytes'] / GIB:.2f} GiB ({versus}), "
            f"max host {s['max_host_bytes'] / GIB:.2f} GiB, {s['violations']} violations")
    job = s.get("job") or []
    line += f"; ran: {s['steps']} steps, " + ", ".join(job) if job else f"; ran: {s['steps']} steps only"
    if s.get("max_job_peak_device_bytes", 0) > s["max_peak_device_bytes"]:
        line += f"; job peak {s['max_job_peak_device_bytes'] / GIB:.2f} GiB"
    if s.get("stopped"):
        line += f"; stopped on rank(s) {', '.join(map(str, s['stopped']))}"
    return line


def one_step_note(s: dict) -> str:
    """Why one step's peak is not set beside the estimator's peak (printed before the summary line)."""
    return (f"note: one step ends before AdamW's states exist ({s['estimator_optimizer_states_bytes'] / GIB:.2f} GiB "
            f"per rank by the estimator, made by the first optimizer step after the step's backward), so it never "
            f"reaches the estimator's peak, a step from step 2 on; rehearse 2 steps (the default) for that figure")


def plot(ranks: dict, summary: dict, path: str) -> None:
    """Device bytes over each rank's events (setup, steps), the phases' starts marked, the capacity as a line."""
    import matplotlib  # the plot extra: only where a picture is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

    fig, ax = plt.subplots(figsize=(12, 5))
    for rank, r in sorted(ranks.items()):
        pts = r["series"]["points"]
        ax.plot([p[0] for p in pts], [p[1] / GIB for p in pts], label=f"rank {rank}", lw=1)
    first = ranks[min(ranks)]
    for i, label in phase_starts(first["series"]["marks"]):
        ax.axvline(i, color="grey", lw=0.5, ls=":")
        ax.text(i, 0, label, rotation=90, fontsize=6, va="bottom")
    ax.axhline(summary["device_capacity_bytes"] / GIB, color="red", lw=0.8, label="usable device memory")
    ax.axhline(summary["estimator_peak_bytes"] / GIB, color="black", lw=0.8, ls="--", label="estimator peak")
    ax.set_xlabel("allocation events (setup, then each step)")
    ax.set_ylabel("device GiB (rehearsed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def phase_starts(marks: list) -> list:
    """The first event of setup and of each step's forward, backward and optimizer: [(index, short label)]."""
    out, seen = [], set()
    for i, label in marks:
        key = "setup" if label.startswith("setup") else phase(label)
        if key not in seen:
            seen.add(key)
            out.append((i, key))
    return out
