"""Hardware profiles (``configs/hardware/*.yaml``) and measured overrides.

    hw = load_hardware("h100")                        # or a path: configs/hardware/h100.yaml
    hw = hw.with_measured({"pcie_gbps": 21.3})        # e.g. from the Memo profiler (memory/memo/profiler.py)
    hw = load_hardware("h100", {"efficiency": {"attention_fwd": 0.35}})   # a what-if (tools/estimate.py --hw-set)

Bandwidths are *effective* figures in GB/s (1e9 bytes/s), one direction, per GPU: what a collective or a pinned copy
reaches, not the datasheet peak. Memory sizes are GiB (2**30 bytes), as ``nvidia-smi`` and ``torch.cuda`` report.

Kernel efficiencies: ``efficiency`` holds the assumed ones (written by hand, said so wherever they are printed);
``attention_measured`` the attention kernels' table that ``bench/attention_kernels.py`` measured on a GPU (its name,
the date, the versions: ``attention/kernel_table.py``), which replaces the assumed attention efficiencies for every
backend and call it has.
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
    """Fractions of peak FLOPs reached by the kernels, as assumed (written by hand; the measured attention ones are
    ``HardwareProfile.attention_measured``)."""

    gemm: float = 0.70
    attention_fwd: float = 0.60
    attention_bwd: float = 0.50

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            check(0.0 < v <= 1.0, f"hardware.efficiency.{f.name} ({v}) must be in (0, 1]")


@dataclass
class HardwareProfile:
    name: str = "unnamed"
    device: Literal["cuda", "cpu"] = "cuda"
    memory_gib: float = 80.0
    reserved_gib: float = 2.0  # never available to tensors (context, communication buffers, workspaces)
    peak_tflops_bf16: float = 989.0
    peak_tflops_fp32: float = 67.0
    hbm_gbps: float = 3350.0
    pcie_gbps: float = 25.0
    nvlink_gbps: float = 360.0
    ib_gbps: float = 45.0
    gpus_per_node: int = 8
    host_memory_gib: float = 2048.0
    host_usable_fraction: float = 0.8
    efficiency: Efficiency = field(default_factory=Efficiency)
    gpu_names: tuple = ()  # what torch.cuda.get_device_name says of this GPU contains one of these (bench/)
    attention_measured: Optional[KernelTable] = None  # bench/attention_kernels.py's table (kernel_table.py)
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

    def link_bytes_per_s(self, group_ranks: int, stride: int) -> float:
        """Bandwidth of a collective over ``group_ranks`` ranks spaced ``stride`` apart in the rank grid: NVLink
        when the whole group sits in one node (``group_ranks * stride <= gpus_per_node``), else InfiniBand."""
        inside = group_ranks * stride <= self.gpus_per_node
        return (self.nvlink_gbps if inside else self.ib_gbps) * GB

    def with_measured(self, measured: dict) -> "HardwareProfile":
        """A copy with measured values (``pcie_gbps``, ``host_memory_gib``, ``layer_forward_seconds``, ...)."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = [k for k in measured if k not in valid]
        if unknown:
            raise ConfigError(f"unknown measured input '{unknown[0]}'; valid: {', '.join(sorted(valid))}")
        return dataclasses.replace(self, **{k: v for k, v in measured.items() if v is not None})


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
    raw.update(overrides)
    eff = build_section(Efficiency, eff_raw, "hardware.efficiency")
    table = raw.pop(KEY, None)
    names = raw.pop("gpu_names", None) or []
    check(isinstance(names, list) and all(isinstance(n, str) for n in names),
          f"{path}: hardware.gpu_names must be a list of names")
    hw = build_section(HardwareProfile, raw, "hardware")
    hw.efficiency, hw.gpu_names = eff, tuple(names)
    hw.attention_measured = parse_table(table, path) if table else None
    return hw


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
