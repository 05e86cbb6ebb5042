"""The plan format (``megatron_lc.plan/1``, public: docs/memory_planning.md): an offset for every request of a
trace, the peak, the max-live lower bound, the framework-buffer ``arena`` section; read, validated, written.

    {"format": "megatron_lc.plan/1", "peak_bytes": N, "lower_bound_bytes": N, "status": "optimal",
     "offsets": {"7": 0, ...}, "sizes": {"7": 8388608, ...}, "order": [7, ...], "tags": {"9": "mst.mlp_chunk"},
     "persistent": {"memo.round0": N}, "alignment": 512, "solver": "greedy+cpsat", "solve_seconds": 0.4,
     "levels": {...}}
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..memory.arena import ALIGNMENT
from .solver.dsa import align_size
from .solver.rects import PlanError, validate
from .trace import Trace

FORMAT = "megatron_lc.plan/1"


@dataclass
class Plan:
    """Offsets of every request of a trace (keys: trace ids), the peak, the max-live lower bound, the status."""

    offsets: dict
    sizes: dict
    order: list
    peak_bytes: int
    lower_bound_bytes: int
    status: str
    solver: str
    solve_seconds: float
    alignment: int = ALIGNMENT
    tags: dict = field(default_factory=dict)
    persistent: dict = field(default_factory=dict)
    levels: dict = field(default_factory=dict)
    arena: dict = field(default_factory=dict)  # framework buffers only: see plan_arena

    def to_json(self) -> dict:
        return {"format": FORMAT, "peak_bytes": self.peak_bytes, "lower_bound_bytes": self.lower_bound_bytes,
                "status": self.status, "solver": self.solver, "solve_seconds": round(self.solve_seconds, 4),
                "alignment": self.alignment, "offsets": {str(k): int(v) for k, v in self.offsets.items()},
                "sizes": {str(k): int(v) for k, v in self.sizes.items()}, "order": [int(i) for i in self.order],
                "tags": {str(k): v for k, v in self.tags.items()}, "persistent": dict(self.persistent),
                "levels": self.levels, "arena": self.arena}

    @classmethod
    def from_json(cls, d: dict) -> "Plan":
        if d.get("format", FORMAT) != FORMAT:
            raise PlanError(f"plan format {d.get('format')!r} is not {FORMAT!r}")
        for k in ("peak_bytes", "lower_bound_bytes", "offsets"):
            if k not in d:
                raise PlanError(f"plan has no {k!r}")
        offsets = {int(k): int(v) for k, v in d["offsets"].items()}
        sizes = {int(k): int(v) for k, v in d.get("sizes", {}).items()}
        return cls(offsets, sizes, [int(i) for i in d.get("order", offsets)], int(d["peak_bytes"]),
                   int(d["lower_bound_bytes"]), d.get("status", "unknown"), d.get("solver", "unknown"),
                   float(d.get("solve_seconds", 0.0)), int(d.get("alignment", ALIGNMENT)),
                   {int(k): v for k, v in d.get("tags", {}).items()}, dict(d.get("persistent", {})),
                   d.get("levels", {}), d.get("arena", {}))

    @classmethod
    def load(cls, path: str) -> "Plan":
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise PlanError(f"cannot read plan {path}: {e}") from None
        return cls.from_json(d)

    def validate(self, trace: Trace) -> None:
        """Raise PlanError unless this plan places every request of ``trace`` with no two live ones overlapping."""
        reqs = trace.requests()
        missing = [r.id for r in reqs if r.id not in self.offsets]
        if missing:
            raise PlanError(f"plan has no offset for ids {missing[:5]}{'...' if len(missing) > 5 else ''}")
        sizes = np.array([align_size(r.size, self.alignment) for r in reqs], dtype=np.int64)
        for r, s in zip(reqs, sizes):
            if self.sizes and self.sizes.get(r.id, s) != s:
                raise PlanError(f"id {r.id}: plan size {self.sizes[r.id]} != trace size {s} (aligned)")
        validate([r.id for r in reqs], sizes, np.array([r.start for r in reqs]), np.array([r.end for r in reqs]),
                 np.array([self.offsets[r.id] for r in reqs], dtype=np.int64), self.peak_bytes)

    def write(self, path: str, trace: Trace) -> None:
        """Validate against ``trace``, then write the JSON."""
        self.validate(trace)
        with open(path, "w") as f:
            json.dump(self.to_json(), f)
