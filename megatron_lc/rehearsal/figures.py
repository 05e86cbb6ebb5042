"""A rank's figures from its trace: device bytes over the events, the peak and its moment, the setup's own peak,
what is live at the peak (parameters, gradients, optimizer states, the rest: activations kept, the working set and
communication buffers), host bytes, bytes sent per collective and moved between host and device."""
from __future__ import annotations

from ..planning.trace import Trace
from .moments import Moments

SERIES_POINTS = 2000  # the picture's resolution: the series is thinned to about this many points (peaks kept)


def _storages(tracer, tensors) -> set:
    ids = (tracer.request_id(t) for t in tensors if t is not None)
    return {i for i in ids if i is not None}


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class ModelStates:
    """The request ids of the parameters, gradients and optimizer states, taken at every optimizer step (each
    step's gradients are new storages) -- hooks on the optimizer (``install``)."""

    def __init__(self, tracer, trainer):
        self.tracer, self.trainer = tracer, trainer
        self.parts: dict = {}  # request id -> "parameters" | "gradients" | "optimizer states"

    def install(self) -> None:
        opt = self.trainer.optimizer
        opt.register_step_pre_hook(lambda o, args, kwargs: self.take())
        opt.register_step_post_hook(lambda o, args, kwargs: self.take())

    def take(self) -> None:
        model, opt = self.trainer.model, self.trainer.optimizer
        params = [_local(p) for p in model.parameters()]
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        states = [_local(v) for st in opt.state.values() for v in st.values() if hasattr(v, "shape")]
        for name, ts in (("parameters", params), ("gradients", grads), ("optimizer states", states)):
            for i in _storages(self.tracer, ts):
                self.parts.setdefault(i, name)

    def host(self, offloaded: bool) -> set:
        """What lives on the host: the host pool's allocation and, with FSDP2's CPU offload, every shard, gradient
        and AdamW state."""
        host = _storages(self.tracer, [self.trainer.ctx.host_pool.data])
        return host | set(self.parts) if offloaded else host


def rank_figures(trace: Trace, moments: Moments, parts: dict, host: set, absent: frozenset = frozenset()) -> dict:
    """Device / host live bytes after every event, the peaks and their moments, the breakdown at the device peak;
    the peak of the training steps alone (``step_peak_bytes``: what the estimator's peak is set beside) and each
    part of the job's (``phases``: ``setup``, ``steps``, ``validation``, ``save``... -- ``Moments.segments``).

    A GPU run without FSDP2 builds the model on the host (setup's ``build`` stage) and its ``device`` stage moves it:
    what the build made and is still alive after the device stage is where a GPU run's ``.to(device)`` put its copy
    -- in a rehearsal, built on the stand-in device, the same storages, counted as host until then and as device from
    then on. With FSDP2 the build is on the meta device: ``absent`` (storages that hold no memory anywhere, the meta
    device's) count 0 bytes."""
    events = trace.events
    start = {label: i for i, label in reversed(moments.log)}  # the first index of every label
    build = (start.get("setup build", 0), start.get("setup device", 0))
    moved_at = start.get("setup runtimes", len(events))
    host = set(host)
    built = {e.id for e in events[build[0]:build[1]] if e.op == "malloc"}
    live = {"device": 0, "host": 0}
    series, sizes = [], {}
    best = {"device": (0, -1), "host": (0, -1), "total": (0, -1)}
    setup_end = next((i for i, label in moments.log if label.startswith("step 0")), len(events))
    setup_best = (0, -1)
    parts_of_job, nxt = {}, 0  # segment name -> [device peak, its event, host peak]; the next segment's position
    seg = parts_of_job.setdefault(moments.segments[0][1], [0, 0, 0])
    for i, e in enumerate(events):
        while nxt < len(moments.segments) and moments.segments[nxt][0] <= i:
            nxt += 1
        if i == moved_at:  # the build's survivors reach the device (in setup: its part of the job holds them)
            moved = {r for r in built if r in sizes and r not in host}
            n = sum(sizes[r] for r in moved)
            live["host"], live["device"] = live["host"] - n, live["device"] + n
            built -= moved
            if seg[0] < live["device"]:
                seg[0], seg[1] = live["device"], i
        seg = parts_of_job.setdefault(moments.segments[nxt - 1][1], [0, i, 0])
        side = "host" if e.id in host or e.id in built else "device"
        if e.op == "malloc":
            sizes[e.id] = 0 if e.id in absent else e.size
            live[side] += sizes[e.id]
        else:
            live[side] -= sizes.pop(e.id, 0)
        series.append(live["device"])
        for s, n in (*live.items(), ("total", live["device"] + live["host"])):
            if n > best[s][0]:
                best[s] = (n, i)
        if i < setup_end and live["device"] > setup_best[0]:
            setup_best = (live["device"], i)
        if live["device"] > seg[0]:
            seg[0], seg[1] = live["device"], i
        seg[2] = max(seg[2], live["host"])
    peak, at = best["device"]
    breakdown: dict = {}
    alive = {}
    for i, e in enumerate(events[:at + 1]):
        if e.op == "malloc" and e.id not in absent:
            alive[e.id] = e.size
        else:
            alive.pop(e.id, None)
    for rid, size in alive.items():
        if rid in host or (rid in built and at < moved_at):
            continue
        name = parts.get(rid, "activations, working set, communication")
        breakdown[name] = breakdown.get(name, 0) + size
    steps = parts_of_job.get("steps", [peak, at, 0])
    return {"device": {"peak_bytes": peak, "peak_moment": moments.at(at), "peak_event": at,
                       "step_peak_bytes": steps[0], "step_peak_moment": moments.at(steps[1]),
                       "setup_peak_bytes": setup_best[0], "setup_peak_moment": moments.at(max(setup_best[1], 0)),
                       "end_bytes": live["device"], "breakdown_at_peak": breakdown},
            "phases": {name: {"device_peak_bytes": d, "device_peak_moment": moments.at(j), "host_peak_bytes": h}
                       for name, (d, j, h) in parts_of_job.items()},
            "host": {"peak_bytes": best["host"][0], "end_bytes": live["host"]},
            "total_peak_bytes": best["total"][0],  # device and host together: what a CPU run's tracker sees
            "series": _thin(series, moments)}


def _thin(series: list, moments: Moments) -> dict:
    """About ``SERIES_POINTS`` points of the device series (each the max of its stretch) and every moment's start."""
    step = max(1, len(series) // SERIES_POINTS)
    points = [[i, max(series[i:i + step])] for i in range(0, len(series), step)]
    return {"events": len(series), "points": points, "marks": [[i, label] for i, label in moments.log]}
