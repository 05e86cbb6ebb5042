"""Memory request traces: the planner's input (a public format, documented in docs/memory_planning.md).

One JSON object a line, in request order; time is the event's position (0-based) in the trace:

    {"op": "malloc", "id": 7, "size": 8388608, "layer": 0, "phase": "fwd"}
    {"op": "free", "id": 7, "size": 8388608, "layer": 0, "phase": "fwd"}

``layer`` (int) and ``phase`` ("fwd" | "bwd") are optional: a maximal run of consecutive events with the same
(layer, phase) is a *layer block* for the bi-level plan. ``tag`` (str, optional, on malloc) names a framework buffer
requested through the arena (``arena.buffer(tag, ...)``). A tensor never freed lives to the end of the trace.

A request (tensor) ``i`` occupies the half-open time interval ``[malloc position, free position)``; two requests
conflict when their intervals intersect. Example: ``malloc 1, malloc 2, free 1, malloc 3`` gives 1: [0, 2),
2: [1, 4) (never freed), 3: [3, 4); 1 and 3 may share addresses, 2 conflicts with both.
"""
from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from typing import Iterable, Optional

PHASES = ("fwd", "bwd")


class TraceError(ValueError):
    """A corrupt or inconsistent trace; the message names the line (1-based) and the id."""


@dataclass
class Event:
    op: str  # "malloc" | "free"
    id: int
    size: int
    layer: Optional[int] = None
    phase: Optional[str] = None
    tag: Optional[str] = None

    def to_json(self) -> dict:
        d = {"op": self.op, "id": self.id, "size": self.size}
        for k in ("layer", "phase", "tag"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d


@dataclass
class Request:
    """One tensor: ``size`` bytes live on ``[start, end)`` (event positions)."""

    id: int
    size: int
    start: int
    end: int
    tag: Optional[str] = None


@dataclass
class Block:
    """A layer block: events ``[start, end)`` all marked ``(layer, phase)``."""

    layer: int
    phase: str
    start: int
    end: int


@dataclass
class Trace:
    events: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # free-form description (model, seq length, ...); not part of a line
    # the time of each event when the source had times (MiniMalloc's CSV): requests keep their own lifetimes
    # instead of event positions (plots show them); the planner reads only their order (``overlap_times``)
    times: Optional[list] = None

    # ---- I/O -----------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str) -> "Trace":
        """Read a JSONL trace and validate it (TraceError names the bad line)."""
        events = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{path} line {n}: not JSON ({e.msg})") from None
                events.append(parse_event(d, f"{path} line {n}"))
        t = cls(events)
        t.validate(where=path)
        return t

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps(e.to_json()) + "\n")

    # ---- checks and derived views --------------------------------------------------------------------------
    def validate(self, where: str = "trace") -> None:
        """Raise TraceError on: free before malloc, free of an unknown id, double free, an id allocated twice,
        a free whose size differs from its malloc, negative sizes, bad marks."""
        malloc_at: dict = {}
        free_at: dict = {}
        first_malloc = {}
        for n, e in enumerate(self.events):
            if e.op == "malloc":
                first_malloc.setdefault(e.id, n)
        for n, e in enumerate(self.events):
            at = f"{where} line {n + 1}"
            if e.size < 0:
                raise TraceError(f"{at}: id {e.id} has negative size {e.size}")
            if e.phase is not None and e.phase not in PHASES:
                raise TraceError(f"{at}: phase {e.phase!r} is not one of {PHASES}")
            if (e.layer is None) != (e.phase is None) and e.layer is not None:
                raise TraceError(f"{at}: a layer mark needs a phase (layer {e.layer}, phase None)")
            if e.op == "malloc":
                if e.id in malloc_at:
                    raise TraceError(f"{at}: id {e.id} allocated twice (first at line {malloc_at[e.id] + 1}); "
                                     "ids must be unique in a trace")
                malloc_at[e.id] = n
            else:
                if e.id not in malloc_at:
                    if e.id in first_malloc:
                        raise TraceError(f"{at}: free of id {e.id} before its malloc at line {first_malloc[e.id] + 1}")
                    raise TraceError(f"{at}: free of unknown id {e.id} (never allocated)")
                if e.id in free_at:
                    raise TraceError(f"{at}: double free of id {e.id} (already freed at line {free_at[e.id] + 1})")
                m = self.events[malloc_at[e.id]]
                if m.size != e.size:
                    raise TraceError(f"{at}: free of id {e.id} says {e.size} bytes, its malloc at line "
                                     f"{malloc_at[e.id] + 1} said {m.size}")
                free_at[e.id] = n

    def requests(self) -> list:
        """The tensors of the trace in malloc order (assumes ``validate()`` passed)."""
        out, by_id = [], {}
        at = self.times if self.times is not None else range(len(self.events))
        end = (self.times[-1] + 1) if self.times else len(self.events)
        for t, e in zip(at, self.events):
            if e.op == "malloc":
                r = Request(e.id, e.size, t, end, e.tag)
                by_id[e.id] = r
                out.append(r)
            else:
                by_id[e.id].end = t
        return out

    def overlap_times(self) -> tuple[list, list]:
        """Each request's ``[start, end)`` (``requests()`` order) counted in runs of consecutive mallocs or frees:
        all that the overlap order defines, so a trace, the MiniMalloc CSV it was written from and that CSV with its
        times stretched or compressed give the same. Example: malloc 1, malloc 2, free 1, malloc 3 are the runs
        {m1, m2} 0, {f1} 1, {m3} 2: 1 on [0, 1), 2 on [0, 3) (never freed: one past the last run), 3 on [2, 3)."""
        run, prev, start, end = -1, None, {}, {}
        for e in self.events:
            if e.op != prev:
                run, prev = run + 1, e.op
            (start if e.op == "malloc" else end)[e.id] = run
        ids = [e.id for e in self.events if e.op == "malloc"]
        return [start[i] for i in ids], [end.get(i, run + 1) for i in ids]

    def blocks(self) -> list:
        """Maximal runs of consecutive events with the same ``(layer, phase)`` (events outside layers excluded)."""
        out = []
        for n, e in enumerate(self.events):
            if e.layer is None:
                continue
            if out and out[-1].end == n and (out[-1].layer, out[-1].phase) == (e.layer, e.phase):
                out[-1].end = n + 1
            else:
                out.append(Block(e.layer, e.phase, n, n + 1))
        return out

    @classmethod
    def from_intervals(cls, rows: Iterable[tuple]) -> "Trace":
        """A trace of buffers ``(id, lower, upper, size)`` living on ``[lower, upper)`` (MiniMalloc's CSV rows):
        events sorted by time, frees before mallocs at one time, so the same pairs conflict; ``times`` keeps each
        event's time, so ``requests()`` gives ``[lower, upper)``. Example: rows (1, 0, 10, 4), (2, 10, 30, 4) give
        free 1 before malloc 2 at time 10, and requests 1: [0, 10), 2: [10, 30)."""
        ev = []
        for i, lo, up, size in rows:
            ev += [(int(lo), 1, int(i), int(size)), (int(up), 0, int(i), int(size))]
        ev.sort()
        return cls([Event("malloc" if kind else "free", i, size) for _, kind, i, size in ev], {},
                   [t for t, _, _, _ in ev])

    @classmethod
    def load_csv(cls, path: str) -> "Trace":
        """MiniMalloc's input format: a header ``id,lower,upper,size``, one buffer a line (integer ids). Written as
        a trace, ``Trace.load_csv("B.1048576.csv").dump("B.jsonl")``, it is the same instance to the planner."""
        with open(path) as f:
            return cls.from_intervals((r["id"], r["lower"], r["upper"], r["size"]) for r in csv.DictReader(f))

    def subset(self, ids: Iterable[int]) -> "Trace":
        """The events of the given ids only, in order (marks kept)."""
        keep = set(ids)
        times = None if self.times is None else [t for t, e in zip(self.times, self.events) if e.id in keep]
        return Trace([e for e in self.events if e.id in keep], dict(self.meta), times)

    def stats(self) -> dict:
        reqs = self.requests()
        return {"events": len(self.events), "requests": len(reqs), "blocks": len(self.blocks()),
                "total_bytes": sum(r.size for r in reqs), "max_live_bytes": max_live_bytes(reqs)}


def parse_event(d: dict, at: str = "event") -> Event:
    """One trace line (a dict) -> Event, with TraceError naming ``at`` on a missing or wrongly typed key."""
    if not isinstance(d, dict):
        raise TraceError(f"{at}: expected a JSON object, got {type(d).__name__}")
    op = d.get("op")
    if op not in ("malloc", "free"):
        raise TraceError(f"{at}: op {op!r} is not 'malloc' or 'free'")
    for k in ("id", "size"):
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool):
            raise TraceError(f"{at}: {k!r} must be an integer, got {d.get(k)!r}")
    layer, phase, tag = d.get("layer"), d.get("phase"), d.get("tag")
    if layer is not None and (not isinstance(layer, int) or isinstance(layer, bool)):
        raise TraceError(f"{at}: 'layer' must be an integer, got {layer!r}")
    if tag is not None and not isinstance(tag, str):
        raise TraceError(f"{at}: 'tag' must be a string, got {tag!r}")
    unknown = set(d) - {"op", "id", "size", "layer", "phase", "tag"}
    if unknown:
        raise TraceError(f"{at}: unknown keys {sorted(unknown)} (valid: op, id, size, layer, phase, tag)")
    return Event(op, d["id"], d["size"], layer, phase, tag)


def max_live_bytes(requests: list) -> int:
    """The max-live lower bound: the largest total size of requests live at one time."""
    deltas: dict = {}
    for r in requests:
        if r.size and r.end > r.start:
            deltas[r.start] = deltas.get(r.start, 0) + r.size
            deltas[r.end] = deltas.get(r.end, 0) - r.size
    live = best = 0
    for t in sorted(deltas):
        live += deltas[t]
        best = max(best, live)
    return best
