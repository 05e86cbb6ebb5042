"""The measured attention-kernel table: what ``bench/attention_kernels.py`` writes into a GPU's hardware profile
(``configs/hardware/<gpu>.yaml``, key ``attention_measured``), what ``parallel.attention_backend: auto`` picks from
on a GPU of that generation, and what the estimator takes its attention efficiencies from::

    attention_measured:
      gpu: NVIDIA H100 80GB HBM3          # torch.cuda.get_device_name(); capability: its generation
      capability: '9.0'
      date: '2026-12-01'
      versions: {torch: 2.13.0+cu128, cuda: '12.8', cudnn: 91002}
      peak_tflops: 989                    # the profile's dense bf16 peak the efficiencies divide by
      calls:                              # the kernel calls of the shipped layouts (one call kind each)
        ring_diagonal: {sq: 131072, sk: 131072, nq: 32, nkv: 8, d: 128, causal: true}
      backends:                           # forward, and backward from an external lse: TFLOP/s and efficiency
        cudnn: {ring_diagonal: {fwd_tflops: 512.0, bwd_tflops: 401.0, fwd: 0.518, bwd: 0.405}}

A call kind is one shape the step calls a kernel at (``CALL_KINDS``); a layout's attention is a mix of them, weighted
by FLOPs (``efficiency``). A backend that failed a kind (out of memory, unsupported) has no entry for it and is never
preferred for a layout that calls it. ``auto`` on a GPU (``fastest_for_gpu``): the table of the same GPU, else of
its generation (compute capability), its fastest backend among those this process can run; no table: ``torch``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

import yaml

from ..config.base import ConfigError, read_yaml_mapping

HARDWARE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "configs", "hardware")
KEY = "attention_measured"
# the kernel calls of the shipped layouts (``attention/ring.py``, ``ulysses.py``, ``fpdt/pipeline.py``)
CALL_KINDS = ("ring_diagonal", "ring_block", "ulysses", "fpdt_diagonal", "fpdt_block")
BWD_FLOPS = 2.5  # a flash-style backward's FLOPs over the forward's (QK^T recomputed), as the estimator counts


@dataclass(frozen=True)
class KernelTable:
    """One measurement (module doc). ``backends[name][kind] = (fwd, bwd)`` efficiencies (fractions of peak)."""

    gpu: str
    capability: str
    date: str
    versions: dict
    backends: dict
    calls: dict = field(default_factory=dict)
    tflops: dict = field(default_factory=dict)  # backends[name][kind] = (fwd TFLOP/s, bwd TFLOP/s)

    @property
    def source(self) -> str:
        """How the estimator names these numbers: ``measured (NVIDIA H100 80GB HBM3, 2026-12-01)``."""
        return f"measured ({self.gpu}, {self.date})"

    def efficiency(self, backend: str, weights: dict) -> Optional[tuple]:
        """(fwd, bwd) of ``backend`` over call kinds weighted by FLOPs (``{kind: weight}``): time-weighted, so a
        slow kind counts by the time it takes; None when a kind with weight is not measured for it."""
        per = self.backends.get(backend, {})
        if not weights or any(w > 0 and k not in per for k, w in weights.items()):
            return None
        total = sum(weights.values())
        fwd = total / sum(w / per[k][0] for k, w in weights.items() if w > 0)
        bwd = total / sum(w / per[k][1] for k, w in weights.items() if w > 0)
        return fwd, bwd

    def seconds_per_flop(self, backend: str, weights: Optional[dict] = None) -> Optional[float]:
        """Forward + backward time of a unit of forward FLOPs at peak 1 (lower is faster); ``weights`` None: every
        call kind measured, equally."""
        weights = weights if weights is not None else {k: 1.0 for k in CALL_KINDS if any(
            k in per for per in self.backends.values())}
        eff = self.efficiency(backend, weights)
        return None if eff is None else 1.0 / eff[0] + BWD_FLOPS / eff[1]

    def fastest(self, candidates: Iterable[str], weights: Optional[dict] = None) -> Optional[str]:
        """The fastest of ``candidates`` measured for these call kinds (None: none is)."""
        timed = [(t, name) for name in candidates if (t := self.seconds_per_flop(name, weights)) is not None]
        return min(timed)[1] if timed else None


def parse_table(raw, where: str) -> KernelTable:
    """The ``attention_measured`` mapping of a profile; one-line ConfigError naming ``where`` on a mistake."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {KEY} must be a mapping")
    missing = [k for k in ("gpu", "capability", "date", "backends") if k not in raw]
    if missing:
        raise ConfigError(f"{where}: {KEY} lacks {', '.join(missing)}")
    effs, tflops = {}, {}
    for name, kinds in (raw["backends"] or {}).items():
        for kind, rec in (kinds or {}).items():
            if kind not in CALL_KINDS:
                raise ConfigError(f"{where}: {KEY}.backends.{name}: unknown call kind '{kind}'; valid: "
                                  f"{', '.join(CALL_KINDS)}")
            if not isinstance(rec, dict) or not all(0 < float(rec.get(x, 0)) <= 1 for x in ("fwd", "bwd")):
                raise ConfigError(f"{where}: {KEY}.backends.{name}.{kind} needs fwd and bwd efficiencies in (0, 1]")
            effs.setdefault(name, {})[kind] = (float(rec["fwd"]), float(rec["bwd"]))
            tflops.setdefault(name, {})[kind] = (rec.get("fwd_tflops"), rec.get("bwd_tflops"))
    return KernelTable(str(raw["gpu"]), str(raw["capability"]), str(raw["date"]), dict(raw.get("versions") or {}),
                       effs, dict(raw.get("calls") or {}), tflops)


def profile_paths(hardware_dir: str = HARDWARE_DIR) -> list:
    return sorted(os.path.join(hardware_dir, f) for f in os.listdir(hardware_dir) if f.endswith(".yaml")) \
        if os.path.isdir(hardware_dir) else []


def tables(hardware_dir: str = HARDWARE_DIR) -> list:
    """Every measured table of the profiles in ``hardware_dir``, in file order."""
    out = []
    for path in profile_paths(hardware_dir):
        raw = read_yaml_mapping(path, "a hardware profile must be a mapping of keys")
        if raw.get(KEY):
            out.append(parse_table(raw[KEY], path))
    return out


def table_for_gpu(name: str, capability: str, hardware_dir: str = HARDWARE_DIR) -> Optional[KernelTable]:
    """The table measured on this GPU model, else the newest of its generation (same compute capability major)."""
    found = tables(hardware_dir)
    same = [t for t in found if t.gpu == name]
    generation = [t for t in found if t.capability.split(".")[0] == capability.split(".")[0]]
    pick = same or generation
    return max(pick, key=lambda t: t.date) if pick else None


def write_table(path: str, table: dict) -> None:
    """Put ``table`` (the ``attention_measured`` mapping) into the profile at ``path`` in place of the one there: it
    is always the file's last key, so the lines from ``attention_measured:`` to the end are replaced and the rest
    of the file -- its comments included -- is kept. Checked by reading it back (``parse_table``)."""
    parse_table(table, path)
    with open(path) as f:
        lines = f.read().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"{KEY}:")), len(lines))
    body = yaml.safe_dump({KEY: table}, sort_keys=False, default_flow_style=None, width=118)
    head = [f"# {KEY}: written by bench/attention_kernels.py on {table['gpu']} on {table['date']}; efficiency = "
            f"TFLOP/s / peak_tflops_bf16"]
    keep = [ln for ln in lines[:start] if not ln.startswith(f"# {KEY}: written by")]
    with open(path, "w") as f:
        f.write("\n".join(keep + head) + "\n" + body)
