"""Hardware profiles (``configs/hardware/*.yaml``) and measured overrides.

    hw = load_hardware("h100")                        # or a path: configs/hardware/h100.yaml
    hw = hw.with_measured({"pcie_gbps": 21.3})        # e.g. from the Memo profiler (memory/memo/profiler.py)
    hw = load_hardware("h100", {"efficiency": {"attention_fwd": 0.35}})   # a what-if (tools/estimate.py --hw-set)

Bandwidths are *effective* figures in GB/s (1e9 bytes/s), one direction, per GPU: what a collective or a pinned copy
reaches, not the datasheet peak. Memory sizes are GiB (2**30 bytes), as ``nvidia-smi`` and ``torch.cuda`` report.

Kernel efficiencies, each with where it comes from: ``efficiency.gemm`` (+ ``gemm_source``); ``attention``, per
backend, the fractions of peak its forward and backward reach and their source (a published measurement, or a
calibration against published runs, ``bench/estimate_papers.py --time``); ``attention_measured``, the table that
``bench/attention_kernels.py`` measured on this GPU, which replaces them for every backend and call it has.
``efficiency.attention_fwd`` / ``attention_bwd``, unset in the shipped profiles, are a what-if set by hand
(``tools/estimate.py --hw-set``) for every backend.

Links: NVLink inside a node, InfiniBand across (``ib_gbps`` per GPU: one NIC each). A ring collective whose group
spans nodes (all-gather, reduce-scatter, all-reduce: tp, FSDP2, gradient sync) runs as NCCL's rings do, each ring
crossing nodes on another NIC, so the group's GPUs in one node pool their NICs (``collective_bytes_per_s``); an
all-to-all sends the share bound for other nodes through the rank's own NIC (``all_to_all_seconds``); a ring of
point-to-point transfers is as fast as its slowest hop (``link_bytes_per_s``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from ..attention.kernel_table import HARDWARE_DIR, KEY, KernelTable, parse_table
from ..config.base import ConfigError, build_section, check, read_yaml_mapping
from ..units import GIB

GB = 1e9


@dataclass
class Efficiency:
    """Fractions of peak FLOPs reached by the GEMMs, and a hand-set attention what-if (module doc)."""

    gemm: float = 0.70
    gemm_source: str = "assumed"
    attention_fwd: Optional[float] = None  # set by hand: every backend's attention forward (a what-if)
    attention_bwd: Optional[float] = None  # ... and backward

    def __post_init__(self) -> None:
        for name in ("gemm", "attention_fwd", "attention_bwd"):
            v = getattr(self, name)
            check(v is None or 0.0 < v <= 1.0, f"hardware.efficiency.{name} ({v}) must be in (0, 1]")


@dataclass(frozen=True)
class KernelFigure:
    """One backend's attention on this GPU: forward and backward fractions of peak (the backward counted as 2.5x
    the forward's FLOPs, as the FlashAttention papers count it), and where the figures come from."""

    fwd: float
    bwd: float
    source: str

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd"):
            check(0.0 < getattr(self, name) <= 1.0,
                  f"hardware.attention: {name} ({getattr(self, name)}) must be in (0, 1]")
        check(bool(self.source), "hardware.attention: every figure needs a source")


@dataclass
class HardwareProfile:
    name: str = "unnamed"
    device: Literal["cuda", "cpu"] = "cuda"
    memory_gib: float = 80.0
    reserved_gib: float = 2.0  # never available to tensors (context, communication buffers, workspaces)
    peak_tflops_bf16: float = 989.0
    peak_tflops_fp32: float = 67.0
    hbm_gbps: float = 3350.0
    pcie_gbps: float = 25.0  # host <-> device of one GPU copying alone, effective, one direction
    pcie_switch_gpus: int = 1  # GPUs behind one PCIe switch, sharing its uplink to the host
    pcie_switch_gbps: Optional[float] = None  # that uplink, effective (None: no sharing)
    nvlink_gbps: float = 360.0
    ib_gbps: float = 45.0
    gpus_per_node: int = 8
    host_memory_gib: float = 2048.0
    host_usable_fraction: float = 0.8
    efficiency: Efficiency = field(default_factory=Efficiency)
    attention: dict = field(default_factory=dict)  # backend -> KernelFigure (the profile's ``attention`` mapping)
    gpu_names: tuple = ()  # what torch.cuda.get_device_name says of this GPU contains one of these (bench/)
    attention_measured: Optional[KernelTable] = None  # bench/attention_kernels.py's table (kernel_table.py)
    # the loop's host work a step that no FLOP or byte count sees (Python, the data, the global norm, AdamW as torch
    # runs it beyond the optimizer term), measured where the host's time is the step's (the CPU profile:
    # bench/estimate_calibration.py --profile); 0 on a GPU, whose queue the host runs ahead of (never measured),
    # unless the loop waits on its host: MsT's harness streams its data each step (bench/paper_times.py, fitted)
    step_overhead_seconds: float = 0.0
    # measured inputs (Memo profiler, §4.3.2): when set they replace the computed values
    layer_forward_seconds: Optional[float] = None  # forward time of one transformer layer at the estimated shape

    def __post_init__(self) -> None:
        for name in ("memory_gib", "peak_tflops_bf16", "peak_tflops_fp32", "hbm_gbps", "pcie_gbps", "nvlink_gbps",
                     "ib_gbps", "host_memory_gib"):
            check(getattr(self, name) > 0, f"hardware.{name} ({getattr(self, name)}) must be positive")
        check(0 <= self.reserved_gib < self.memory_gib,
              f"hardware.reserved_gib ({self.reserved_gib}) must be in [0, memory_gib ({self.memory_gib}))")
        check(self.gpus_per_node >= 1, f"hardware.gpus_per_node ({self.gpus_per_node}) must be >= 1")
        check(0 < self.host_usable_fraction <= 1,
              f"hardware.host_usable_fraction ({self.host_usable_fraction}) must be in (0, 1]")
        check(self.pcie_switch_gpus >= 1, f"hardware.pcie_switch_gpus ({self.pcie_switch_gpus}) must be >= 1")
        check(self.pcie_switch_gbps is None or self.pcie_switch_gbps > 0,
              f"hardware.pcie_switch_gbps ({self.pcie_switch_gbps}) must be positive")
        check(self.step_overhead_seconds >= 0,
              f"hardware.step_overhead_seconds ({self.step_overhead_seconds}) must not be negative")
        check(self.layer_forward_seconds is None or self.layer_forward_seconds > 0,
              f"hardware.layer_forward_seconds ({self.layer_forward_seconds}) must be positive")

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def device_bytes(self) -> float:
        """Bytes a rank can hand to tensors."""
        return (self.memory_gib - self.reserved_gib) * GIB

    @property
    def host_bytes_per_node(self) -> float:
        return self.host_memory_gib * self.host_usable_fraction * GIB

    def peak_flops(self, bf16: bool) -> float:
        return (self.peak_tflops_bf16 if bf16 else self.peak_tflops_fp32) * 1e12

    def spans_nodes(self, group_ranks: int, stride: int) -> bool:
        """A group of ``group_ranks`` ranks spaced ``stride`` apart in the rank grid does not fit in one node."""
        return group_ranks * stride > self.gpus_per_node

    def link_bytes_per_s(self, group_ranks: int, stride: int) -> float:
        """Point to point along a ring of the group: NVLink inside a node, else InfiniBand (the hop that leaves a
        node is the ring's slowest)."""
        return (self.ib_gbps if self.spans_nodes(group_ranks, stride) else self.nvlink_gbps) * GB

    def collective_bytes_per_s(self, group_ranks: int, stride: int) -> float:
        """Bus bandwidth of a ring collective over the group (all-gather, reduce-scatter, all-reduce): NVLink inside
        a node; across nodes NCCL's rings leave each node on as many NICs as the group has GPUs there, so the
        group's ranks in a node pool theirs, up to NVLink. Example, A800 profile (NVLink 160, IB 20 GB/s): tp 64
        over 8 nodes 160 GB/s; gradient sync over dp 8 with stride 8 (one rank a node) 20 GB/s."""
        if not self.spans_nodes(group_ranks, stride):
            return self.nvlink_gbps * GB
        in_node = max(1, min(group_ranks, self.gpus_per_node // stride))
        return min(self.nvlink_gbps, self.ib_gbps * in_node) * GB

    def all_to_all_seconds(self, sent_bytes: float, group_ranks: int, stride: int) -> float:
        """An all-to-all in which a rank sends ``sent_bytes`` in equal shares to the group's other ranks: the shares
        bound for other nodes leave through its NIC while the others cross NVLink. Example: Ulysses 32 over 4 nodes,
        24 of the 31 shares over InfiniBand."""
        if group_ranks <= 1:
            return 0.0
        if not self.spans_nodes(group_ranks, stride):
            return sent_bytes / (self.nvlink_gbps * GB)
        in_node = max(1, min(group_ranks, self.gpus_per_node // stride))
        away = sent_bytes * (group_ranks - in_node) / (group_ranks - 1)
        return max(away / (self.ib_gbps * GB), (sent_bytes - away) / (self.nvlink_gbps * GB))

    def host_copy_bytes_per_s(self, copying: int) -> float:
        """Host <-> device bandwidth of one GPU while ``copying`` GPUs of its node copy at once (every rank runs the
        same schedule: all of them do): the GPUs behind one PCIe switch share its uplink. Example, A800 profile
        (25 GB/s alone, 2 GPUs behind each switch, uplink calibrated on Memo's full-swapping runs): 8 ranks copying
        get ``min(25, uplink / 2)`` each, one rank alone 25."""
        alone = self.pcie_gbps * GB
        if self.pcie_switch_gbps is None:
            return alone
        sharing = max(1, min(copying, self.pcie_switch_gpus))
        return min(alone, self.pcie_switch_gbps * GB / sharing)

    def with_measured(self, measured: dict) -> "HardwareProfile":
        """A copy with measured values (``pcie_gbps``, ``host_memory_gib``, ``layer_forward_seconds``, ...). A
        measured ``pcie_gbps`` (the Memo profiler's, every rank copying) is the effective bandwidth as it is: the
        switch sharing is not applied to it again."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = [k for k in measured if k not in valid]
        if unknown:
            raise ConfigError(f"unknown measured input '{unknown[0]}'; valid: {', '.join(sorted(valid))}")
        values = {k: v for k, v in measured.items() if v is not None}
        if "pcie_gbps" in values and "pcie_switch_gbps" not in values:
            values["pcie_switch_gbps"] = None
        return dataclasses.replace(self, **values)


def resolve_hardware_path(name_or_path: str) -> str:
    """``h100`` -> ``configs/hardware/h100.yaml``; an existing path is returned as is."""
    if os.path.isfile(name_or_path):
        return name_or_path
    cand = os.path.join(HARDWARE_DIR, name_or_path if name_or_path.endswith(".yaml") else name_or_path + ".yaml")
    if os.path.isfile(cand):
        return cand
    known = sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml")) \
        if os.path.isdir(HARDWARE_DIR) else []
    raise ConfigError(f"hardware profile not found: {name_or_path} (known: {', '.join(known)})")


def load_hardware(name_or_path: str, overrides: Optional[dict[str, Any]] = None) -> HardwareProfile:
    """Read a hardware YAML (strict keys, one-line ConfigError on mistakes)."""
    path = resolve_hardware_path(name_or_path)
    raw = read_yaml_mapping(path, "a hardware profile must be a mapping of keys")
    overrides = dict(overrides or {})
    eff_raw = dict(raw.pop("efficiency", None) or {}, **overrides.pop("efficiency", {}))
    att_raw = dict(raw.pop("attention", None) or {})
    for backend, rec in overrides.pop("attention", {}).items():  # a what-if: merged per backend, said so
        att_raw[backend] = {**(att_raw.get(backend) or {}), "source": "set by hand", **rec}
    raw.update(overrides)
    eff = build_section(Efficiency, eff_raw, "hardware.efficiency")
    figures = parse_figures(att_raw, path)
    table = raw.pop(KEY, None)
    names = raw.pop("gpu_names", None) or []
    check(isinstance(names, list) and all(isinstance(n, str) for n in names),
          f"{path}: hardware.gpu_names must be a list of names")
    hw = build_section(HardwareProfile, raw, "hardware")
    hw.efficiency, hw.gpu_names, hw.attention = eff, tuple(names), figures
    hw.attention_measured = parse_table(table, path) if table else None
    return hw


def parse_figures(raw, path: str) -> dict:
    """The profile's ``attention`` mapping, ``{backend: {fwd, bwd, source}}``, as KernelFigures (one-line errors)."""
    check(isinstance(raw, dict), f"{path}: hardware.attention must be a mapping of backend -> {{fwd, bwd, source}}")
    out = {}
    for name, rec in raw.items():
        out[name] = build_section(KernelFigure, rec, f"hardware.attention.{name}")
    return out


def profile_for_gpu(device_name: str, memory_gib: float, hardware_dir: str = HARDWARE_DIR) -> Optional[str]:
    """The profile file whose ``gpu_names`` the device's name contains, the nearest in memory when several do
    (``NVIDIA A100-SXM4-40GB`` -> a100_40gb.yaml); None: no profile names it."""
    found = []
    for f in sorted(os.listdir(hardware_dir)):
        if f.endswith(".yaml"):
            raw = read_yaml_mapping(os.path.join(hardware_dir, f), "a hardware profile must be a mapping of keys")
            if any(n in device_name for n in raw.get("gpu_names") or []):
                found.append((abs(float(raw.get("memory_gib", 0)) - memory_gib), os.path.join(hardware_dir, f)))
    return min(found)[1] if found else None
