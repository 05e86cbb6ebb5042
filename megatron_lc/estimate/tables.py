"""Text tables of an estimate and of a layout search, the inputs measured by the Memo profiler, and writing a chosen
layout back into a config file."""
from __future__ import annotations

import json
import os
from typing import Optional

import yaml

from ..config import ConfigError
from . import Estimate
from ..planning.planner import plan_trace
from ..planning.trace import Trace
from ..units import GIB
from .layout_search import Candidate, config_overrides


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
    lines = [layout_line(est), "", "memory per GPU (persistent parts, then the peak moments)"]
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
    for n in mem.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def search_table(cands: list[Candidate], top: int, best: Optional[Candidate] = None) -> str:
    """The ``top`` layouts, fastest first, numbered by rank; ``*`` marks ``best``, shown after a ``...`` row with its
    own rank when it is not among them. TGS: tokens per GPU per second."""
    rows = [f"{'#':>3} {'layout':60s} {'peak/GPU':>9} {'host/node':>10} {'step s':>9} {'TGS':>8} {'MFU':>6}"]
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
                    f"{e.time.step_seconds:9.2f} {e.time.tokens_per_gpu_per_s:8.1f} {e.time.mfu:6.1%}")
    rows.append("TGS: tokens per GPU per second; MFU: model FLOPs (6sP + 6nhs^2 per sample) over the peak")
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
