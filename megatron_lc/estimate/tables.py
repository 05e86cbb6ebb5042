"""Text tables of an estimate and of a layout search, the inputs measured by the Memo profiler, and writing a chosen
layout back into a config file."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import yaml

from ..config import ConfigError
from . import Estimate, estimate
from ..planning.planner import plan_trace
from ..planning.trace import Trace
from ..units import GIB
from .layout_search import Candidate, config_overrides
from ..attention.kernel_table import BWD_FLOPS
from .ring_balance import ring_balance
from .time_estimate import call_weights


def _gib(b: float) -> str:
    return f"{b / GIB:9.2f} GiB"


def layout_line(est: Estimate) -> str:
    p, m, dims = est.cfg.parallel, est.cfg.memory, est.dims
    mem = [f"recompute={m.recompute_granularity}", f"offload={m.activation_offload}"]
    if m.activation_offload == "memo":
        mem.append(f"alpha={est.memory.alpha:.3f}" + (" (auto)" if m.offload_fraction == "auto" else ""))
    if m.layer_chunk_size is not None:
        mem.append(f"layer_chunk={m.layer_chunk_size}")
    mem.append(f"mst={m.mst}")
    if p.cp_comm_type == "fpdt":
        mem.append(f"fpdt_chunk={m.fpdt_chunk_size} offload={m.fpdt_offload}")
    return (f"{dims.world} x {est.hw.name}: tp={dims.tp} (sp={dims.sequence_parallel}) cp={dims.cp} "
            f"({p.cp_comm_type}, ulysses {p.ulysses_size}) "
            f"dp={dims.dp} zero1={p.use_distributed_optimizer} fsdp2={p.use_torch_fsdp2}"
            + (" (cpu offload)" if p.fsdp_cpu_offload else "") + " | " + " ".join(mem) +
            f" | seq {dims.seq_length:,} micro-batch {dims.micro_batch} x {dims.micro_batches}")


def estimate_table(est: Estimate) -> str:
    """Memory by part, the peak moments, fit / OOM / out-of-host-memory, time by part, step time, TGS, MFU."""
    mem, tm = est.memory, est.time
    lines = [layout_line(est)] + ([balance_line(est.dims)] if est.dims.ranges and ring_balance(est.dims) else [])
    lines += ["", "memory per GPU (persistent parts, then the peak moments)"]
    for k, v in mem.parts.items():
        if v:
            lines.append(f"  {k:34s} {_gib(v)}")
    for k, v in mem.phases.items():
        mark = "  <- peak" if k == mem.peak_phase else ""
        lines.append(f"  at {k:31s} {_gib(v)}{mark}")
    lines.append(f"  {'capacity (memory - reserved)':34s} {_gib(mem.capacity)}")
    lines.append(f"host memory per node                 {_gib(mem.host_per_node)}  of {_gib(mem.host_capacity).strip()}"
                 f" usable ({_gib(mem.host_per_rank).strip()} per GPU)")
    status = {"fits": "FITS", "oom": "OOM (device memory)", "oohm": "OUT OF HOST MEMORY"}[mem.status]
    lines.append(f"status: {status}  (peak {mem.peak / mem.capacity:.0%} of device capacity)")
    lines += ["", "time per step"]
    for k, v in tm.parts.items():
        if v:
            lines.append(f"  {k:34s} {v:10.3f} s")
    lines.append(f"  {'step':34s} {tm.step_seconds:10.3f} s")
    lines.append(f"tokens per GPU per second {tm.tokens_per_gpu_per_s:,.1f}   MFU {tm.mfu:.1%} "
                 f"(model FLOPs 6sP + 6nhs^2 = {tm.model_flops_per_step:.3e} per step)")
    lines += ["  " + line for line in efficiency_sources(est)]
    what_if = hopper_what_if(est)
    if what_if is not None:
        w = what_if.time
        lines.append(f"  what-if, a Hopper-native kernel (parallel.attention_backend={w.attention_backend}): step "
                     f"{w.step_seconds:.1f} s, MFU {w.mfu:.1%}, peak {what_if.memory.peak / GIB:.1f} GiB; forward "
                     f"{w.efficiencies['attention forward'][0]:.2f}, backward "
                     f"{w.efficiencies['attention backward'][0]:.2f} of peak ({w.efficiencies['attention forward'][1]})")
    for n in mem.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def balance_line(dims) -> str:
    """How evenly the ring's layout spreads the attention under documents / windows (``ring_balance.py``):
    ``ring of 8, balanced layout: slowest / mean rank attention 1.00; k/v received by the slowest rank 156,127 rows
    a layer, the zigzag ring's 917,504 (mock documents of a 65,536-token mean)``."""
    b = ring_balance(dims)
    docs = f"mock documents of a {dims.doc_length:,}-token mean" if dims.doc_length else "one document a row"
    wins = sorted({w for w in dims.windows if w is not None})
    return (f"ring of {dims.cp // (dims.ulysses if dims.uses_a2a else 1)}, {dims.cp_layout} layout: slowest / mean "
            f"rank attention {b.imbalance:.2f}; k/v received by the slowest rank {b.rows:,.0f} rows a layer, the "
            f"zigzag ring's {b.ring_rows:,} ({docs}" + (f", windows {wins}" if wins else "") + ")")


def efficiency_sources(est: Estimate) -> list:
    """The kernel efficiencies the time model used, each with its source, the attention's first with the backend
    that will run and why: ``attention that runs: torch (auto: no measured table on H100-80GB) forward 0.34,
    backward 0.33 of peak (FlashAttention-3 paper, ...)``, then ``gemm 0.70 of peak (assumed: ...)``."""
    tm, table = est.time, est.hw.attention_measured
    (g, gs), (f, fs), (b, bs) = (tm.efficiencies[k] for k in ("gemm", "attention forward", "attention backward"))
    if est.backend_named == "auto":
        why = (f"auto: the fastest measured on {table.gpu}" if table is not None else
               f"auto: no kernel measured on {est.hw.name}, so PyTorch's FlashAttention-2-class one")
    else:
        why = "parallel.attention_backend"
    src = fs if fs == bs else f"{fs}; {bs}"
    return [f"attention that runs: {tm.attention_backend} ({why}) forward {f:.2f}, backward {b:.2f} of peak ({src})",
            f"gemm {g:.2f} of peak ({gs})"]


FA2_CLASS, HOPPER_NATIVE = ("torch", "flash"), ("cudnn", "fa3", "fa4")


def hopper_what_if(est: Estimate) -> Optional[Estimate]:
    """The same run with the fastest Hopper-native attention backend this GPU has a figure for (measured, or the
    profile's published one), when the backend that runs is not one: what cuDNN's or FlashAttention-3's kernels
    would give (their memory too: no GQA copies). None on a GPU without such figures, or when one already runs."""
    if est.time.attention_backend in HOPPER_NATIVE or est.dims.device != "cuda":
        return None
    weights, table = call_weights(est.dims), est.hw.attention_measured
    timed = []
    for name in HOPPER_NATIVE:
        eff = table.efficiency(name, weights) if table is not None else None
        if eff is None and name in est.hw.attention:
            eff = (est.hw.attention[name].fwd, est.hw.attention[name].bwd)
        if eff is not None:
            timed.append((1.0 / eff[0] + BWD_FLOPS / eff[1], name))
    if not timed:
        return None
    name = min(timed)[1]
    cfg = dataclasses.replace(est.cfg, parallel=dataclasses.replace(est.cfg.parallel, attention_backend=name))
    return estimate(cfg, est.hw, est.dims.world, states=est.states)


def attention_needed(est: Estimate, world: int, target: float) -> Optional[tuple]:
    """(fwd, bwd): the estimate's attention efficiencies scaled together until MFU reaches ``target`` (bisection:
    the overlaps make step time non-linear in them); None when 100% of peak (the larger of the two) falls short."""
    fwd, bwd = (est.time.efficiencies[k][0] for k in ("attention forward", "attention backward"))

    def mfu(f: float) -> float:
        hw = dataclasses.replace(est.hw, attention_measured=None, efficiency=dataclasses.replace(
            est.hw.efficiency, attention_fwd=fwd * f, attention_bwd=bwd * f))
        return estimate(est.cfg, hw, world, states=est.states).time.mfu

    lo, hi = 0.0, 1.0 / max(fwd, bwd)
    if mfu(hi) < target:
        return None
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mfu(mid) < target else (lo, mid)
    return fwd * hi, bwd * hi


def target_line(est: Estimate, world: int, target: float) -> str:
    """Whether the layout reaches ``target`` MFU, and if not which attention kernel it would need (the measured
    backends that reach it on this GPU, or the kind of kernel when none is measured)."""
    tm, table = est.time, est.hw.attention_measured
    if tm.mfu >= target:
        return f"MFU {tm.mfu:.1%} reaches the {target:.0%} target ({'; '.join(efficiency_sources(est))})"
    need = attention_needed(est, world, target)
    if need is None:
        return (f"{target:.0%} MFU is out of this layout's reach by attention alone: at 100% of peak in attention "
                f"the rest of the step holds it below")
    head = (f"{target:.0%} MFU needs attention at {need[0]:.2f} forward / {need[1]:.2f} backward of peak (now "
            f"{tm.attention_backend} at {tm.efficiencies['attention forward'][0]:.2f} / "
            f"{tm.efficiencies['attention backward'][0]:.2f}, {tm.efficiencies['attention forward'][1]})")
    weights = call_weights(est.dims)
    measured = {b: e for b in (table.backends if table else {}) if (e := table.efficiency(b, weights))}
    if measured:
        ok = [f"{b} ({e[0]:.2f} / {e[1]:.2f})" for b, e in measured.items() if e[0] >= need[0] and e[1] >= need[1]]
        return head + (f"\n  reached by {', '.join(ok)}, {table.source}" if ok else
                       f"\n  no backend measured on {table.gpu} ({table.date}) reaches it")
    published = [f"{b} ({f.fwd:.2f} / {f.bwd:.2f})" for b, f in est.hw.attention.items()
                 if f.fwd >= need[0] and f.bwd >= need[1]]
    if published:
        kind = f"reached by the profile's published figures of {', '.join(published)}"
    else:
        kind = (f"beyond FA2-class kernels ({', '.join(FA2_CLASS)}: about 35% of a Hopper GPU's peak, as "
                f"FlashAttention-3: Fast and Accurate Attention with Asynchrony and Low-precision reports): a "
                f"Hopper-native one, {', '.join(HOPPER_NATIVE)} (parallel.attention_backend)") if need[0] > 0.35 else \
            f"any of {', '.join(FA2_CLASS + HOPPER_NATIVE)} might"
    return (head + f"\n  {kind}; no attention kernel is measured on {est.hw.name}: bash scripts/gpu_check.sh "
            f"measures them on the GPU (bench/attention_kernels.py)")


def search_table(cands: list[Candidate], top: int, best: Optional[Candidate] = None) -> str:
    """The ``top`` layouts, fastest first, numbered by rank; ``*`` marks ``best``, shown after a ``...`` row with its
    own rank when it is not among them. TGS: tokens per GPU per second."""
    rows = [f"{'#':>3} {'layout':60s} {'peak/GPU':>9} {'host/node':>10} {'step s':>9} {'TGS':>8} {'MFU':>6} attn"]
    shown = list(enumerate(cands[:top], 1))
    if best is not None and best not in cands[:top]:
        shown.append((None, None))
        shown.append((cands.index(best) + 1 if best in cands else "-", best))
    for i, c in shown:
        if c is None:
            rows.append(f"{'...':>3}")
            continue
        e = c.est
        mark = "*" if c is best else " "
        rows.append(f"{mark}{i:>2} {c.label():60s} {e.memory.peak / GIB:7.1f}Gi {e.memory.host_per_node / GIB:8.1f}Gi "
                    f"{e.time.step_seconds:9.2f} {e.time.tokens_per_gpu_per_s:8.1f} {e.time.mfu:6.1%} "
                    f"{e.time.attention_backend}")
    rows.append("TGS: tokens per GPU per second; MFU: model FLOPs (6sP + 6nhs^2 per sample) over the peak; attn: the "
                "attention backend that runs, whose efficiencies rank the layouts (auto: the fastest measured on the "
                "GPU, else torch)")
    return "\n".join(rows)


def load_measured(path: str) -> dict:
    """Measured inputs as HardwareProfile overrides, from a YAML/JSON mapping: the Memo profiler's fields
    (``t_layer`` seconds, ``bw_d2h`` bytes/s, ``host_node_bytes``; also nested under ``profile``, as in its log line
    ``memo offload: {...}``) or this module's names (``layer_forward_seconds``, ``pcie_gbps``, ``host_memory_gib``)."""
    if not os.path.isfile(path):
        raise ConfigError(f"measured inputs file not found: {path}")
    with open(path) as f:
        text = f.read()
    if "memo offload:" in text:
        text = text.split("memo offload:", 1)[1]
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML/JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: measured inputs must be a mapping")
    if isinstance(raw.get("profile"), dict):
        raw = raw["profile"]
    out: dict = {}
    mapping = {"t_layer": ("layer_forward_seconds", 1.0), "bw_d2h": ("pcie_gbps", 1e-9),
               "host_node_bytes": ("host_memory_gib", 1.0 / GIB)}
    for key, value in raw.items():
        if key in mapping and isinstance(value, (int, float)) and value == value:  # skip NaN
            name, scale = mapping[key]
            out[name] = float(value) * scale
        elif key in ("layer_forward_seconds", "pcie_gbps", "host_memory_gib", "nvlink_gbps", "ib_gbps",
                     "peak_tflops_bf16", "memory_gib"):
            out[key] = float(value)
    if "host_memory_gib" in out and "host_node_bytes" in raw:
        out["host_usable_fraction"] = 1.0  # the profiler already measured what is available
    return out


def activation_peak_from(plan: Optional[str], trace: Optional[str], time_limit: float = 10.0) -> Optional[float]:
    """Activation arena bytes from a memory plan (``peak_bytes``) or a trace (planned when the planner of
    ``memory/planner.py`` is present, else its max-live lower bound). Formats: docs/memory_planning.md."""
    if plan:
        if not os.path.isfile(plan):
            raise ConfigError(f"plan file not found: {plan}")
        with open(plan) as f:
            data = json.load(f)
        if "peak_bytes" not in data:
            raise ConfigError(f"{plan}: not a memory plan (no peak_bytes)")
        return float(data["peak_bytes"])
    if trace:
        if not os.path.isfile(trace):
            raise ConfigError(f"trace file not found: {trace}")
        return float(plan_trace(Trace.load(trace), time_limit=time_limit).peak_bytes)
    return None


def write_layout(config_path: str, out_path: str, cand: Candidate, hw_name: str, world: int) -> None:
    """Write ``cand``'s parallel/memory overrides into the config at ``config_path`` (saved to ``out_path``); the
    other sections and the leading comment block are kept."""
    with open(config_path) as f:
        text = f.read()
    header = []
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            header.append(line)
        else:
            break
    raw = yaml.safe_load(text) or {}
    for key, value in config_overrides(cand).items():
        section, name = key.split(".")
        raw.setdefault(section, {})
        raw[section] = raw[section] or {}
        if value is None:
            raw[section].pop(name, None)
        else:
            raw[section][name] = value
    e = cand.est
    note = (f"# parallel/memory written by tools/estimate.py --auto for {world} x {hw_name}: {cand.label()}; "
            f"estimated peak {e.memory.peak / GIB:.1f} GiB per GPU, host {e.memory.host_per_node / GIB:.0f} GiB "
            f"per node, step {e.time.step_seconds:.1f} s, MFU {e.time.mfu:.1%}")
    header = [h for h in header if not h.startswith("# parallel/memory written by tools/estimate.py")]
    body = yaml.safe_dump(raw, sort_keys=False, default_flow_style=False)
    with open(out_path, "w") as f:
        f.write("\n".join(header + [note]) + "\n" + body)
