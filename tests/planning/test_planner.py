"""Planner: valid plans on random and captured traces, optimality where greedy meets the bound, bi-level
guarantees, plan validation, the CLI."""
import json
import random

import pytest

from megatron_lc.planning.planner import Plan, plan_trace
from megatron_lc.planning.solver.rects import PlanError, Rects, best_greedy
from bench.synth_traces import LlamaShape, llama_iteration_trace, llama_layer_trace
from megatron_lc.planning.trace import Event, Trace
from megatron_lc.planning.capture.record import capture_iteration
from tests.support.parity import batch_for


def random_trace(n, seed, layers=0, max_units=64):
    """n requests with random sizes (multiples of 512) and lifetimes; with ``layers`` > 0, the same random block
    of transients is repeated per layer in fwd and bwd, with a few long-lived tensors crossing blocks."""
    rng = random.Random(seed)
    ev, live, nid = [], [], 0

    def block(mark, k):
        nonlocal nid
        local, sizes = [], [rng.randrange(1, max_units) * 512 for _ in range(k)]
        for s in sizes:
            if local and rng.random() < 0.4:
                i, sz = local.pop(rng.randrange(len(local)))
                ev.append(Event("free", i, sz, *mark))
            ev.append(Event("malloc", nid, s, *mark))
            (local if rng.random() < 0.8 else live).append((nid, s))
            nid += 1
        for i, sz in local:
            ev.append(Event("free", i, sz, *mark))

    if layers:
        for phase in ("fwd", "bwd"):
            for L in (range(layers) if phase == "fwd" else reversed(range(layers))):
                rng.seed(seed * 7 + (phase == "bwd"))
                block((L, phase), n)
                if phase == "bwd" and live:
                    i, sz = live.pop(0)
                    ev.append(Event("free", i, sz))
        return Trace(ev)
    while nid < n or live:
        if live and (rng.random() < 0.45 or nid >= n):
            i, s = live.pop(rng.randrange(len(live)))
            ev.append(Event("free", i, s))
        else:
            s = rng.randrange(1, max_units) * 512
            ev.append(Event("malloc", nid, s))
            live.append((nid, s))
            nid += 1
    return Trace(ev)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("solver", ["greedy", pytest.param("cpsat", marks=pytest.mark.ortools)])
def test_random_traces_valid(seed, solver):
    t = random_trace(40, seed)
    plan = plan_trace(t, mode="flat", solver=solver, time_limit=1.0)
    plan.validate(t)  # no two live tensors overlap (plan_trace validated too; this is the public check)
    assert plan.peak_bytes >= plan.lower_bound_bytes
    if plan.status == "optimal":
        assert plan.peak_bytes == plan.lower_bound_bytes or "cpsat" in plan.solver


@pytest.mark.ortools
def test_cpsat_improves_on_greedy_and_mip_runs():
    # seed 5 of random_trace(60): greedy is 7% above the bound, CP-SAT proves the bound (measured)
    t = random_trace(60, 5)
    g = plan_trace(t, mode="flat", solver="greedy")
    c = plan_trace(t, mode="flat", solver="cpsat", time_limit=4.0)
    assert c.peak_bytes < g.peak_bytes and c.peak_bytes == c.lower_bound_bytes and c.status == "optimal"
    small = random_trace(12, 1)
    m = plan_trace(small, mode="flat", solver="mip", time_limit=2.0)  # the paper's big-M MIP (scipy HiGHS)
    assert m.peak_bytes == m.lower_bound_bytes and "mip" in m.solver or m.status == "optimal"


def test_peak_equals_lower_bound_when_greedy_reaches_it():
    # stack-like (LIFO) lifetimes: largest-first greedy is optimal on nested intervals
    ev, stack = [], []
    rng = random.Random(3)
    for i in range(200):
        if stack and rng.random() < 0.5:
            j, s = stack.pop()
            ev.append(Event("free", j, s))
        s = rng.randrange(1, 100) * 512
        ev.append(Event("malloc", i, s))
        stack.append((i, s))
    t = Trace(ev)
    plan = plan_trace(t, mode="flat", solver="greedy")
    assert plan.peak_bytes == plan.lower_bound_bytes and plan.status == "optimal"


def test_validate_catches_overlap():
    t = Trace([Event("malloc", 1, 512), Event("malloc", 2, 512), Event("free", 1, 512)])
    bad = Plan({1: 0, 2: 256}, {1: 512, 2: 512}, [1, 2], 1024, 1024, "optimal", "hand", 0.0)
    with pytest.raises(PlanError, match="ids 1 and 2 overlap"):
        bad.validate(t)
    with pytest.raises(PlanError, match="outside"):
        Plan({1: 0, 2: 512}, {}, [1, 2], 512, 1024, "x", "hand", 0.0).validate(t)
    with pytest.raises(PlanError, match="no offset for ids"):
        Plan({1: 0}, {}, [1], 1024, 1024, "x", "hand", 0.0).validate(t)


@pytest.mark.parametrize("seed", range(4))
def test_bilevel_never_worse_than_blocks_apart(seed):
    t = random_trace(12, seed, layers=3)
    for pseudo in ("rectangle", "skyline"):
        plan = plan_trace(t, mode="bilevel", pseudo=pseudo, time_limit=2.0)
        lv = plan.levels
        assert lv["distinct_blocks"] == 2  # identical layers: one fwd and one bwd first-level problem
        assert plan.peak_bytes <= lv["baseline_shared_bytes"] <= lv["baseline_end_to_end_bytes"]


def test_greedy_shapes_respect_skylines():
    # an item made of two rectangles shares one base; a small request fits above the low part
    inst = Rects([0, 0, 1], [0, 5, 0], [5, 10, 5], [4096, 512, 512], 2)
    off, peak, _ = best_greedy(inst)
    assert peak == 4608 and off[1] == 4096
    inst = Rects([0, 0, 1], [0, 5, 5], [5, 10, 10], [4096, 512, 512], 2)
    off, peak, _ = best_greedy(inst)
    assert peak == 4096 and off[1] == 512  # above the second rectangle of item 0, below its first's top


MST = ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4"]


@pytest.mark.parametrize("layers,recompute,overrides", [
    (1, False, []), (4, False, []), (2, True, []),
    # the memory features' traces (Memo's rounding buffers and host copies are storages like any other)
    (4, False, MST), (4, False, ["memory.recompute_granularity=full"]),
    (4, False, ["memory.activation_offload=memo", "memory.offload_fraction=0.5"]),
    (4, False, MST + ["memory.activation_offload=memo", "memory.offload_fraction=0"]),
], ids=["L1", "L4", "L2-checkpoint", "L4-mst", "L4-full-recompute", "L4-memo-a0.5", "L4-mst+memo-a0"])
def test_plans_valid_on_captured_tiny_traces(layers, recompute, overrides):
    from tests.planning.test_trace import _tiny

    cfg, model = _tiny(layers, recompute, overrides)
    t = capture_iteration(model, batch_for(cfg))
    t.validate()
    peaks = {}
    for pseudo in ("rectangle", "skyline"):
        # greedy only: deterministic whatever the machine load (CP-SAT results depend on the time it gets)
        plan = plan_trace(t, mode="bilevel", pseudo=pseudo, solver="greedy")
        plan.validate(t)
        assert plan.peak_bytes <= plan.levels["baseline_shared_bytes"]
        peaks[pseudo] = plan.peak_bytes
    # measured (greedy, traces since the RMSNorm twin of model/norm.py): skyline x1.037 / x1.013 / x1.023 of the bound,
    # the paper's rectangles x1.14 / 1.05 / 1.16; CP-SAT (5 s) reaches x1.000 / 1.003 / 1.000; the memory-feature
    # traces (327-907 requests) x1.037 / 1.016 / 1.000 / 1.017 with skyline. Greedy is a heuristic
    # whose gap moves with the trace: the bound here is "a few percent", the ordering against rectangles is strict.
    assert peaks["skyline"] <= peaks["rectangle"]
    assert peaks["skyline"] <= 1.05 * plan.lower_bound_bytes


@pytest.mark.ortools
def test_cpsat_never_worse_than_greedy_on_a_captured_trace():
    from tests.planning.test_trace import _tiny

    cfg, model = _tiny(2, True, [])
    t = capture_iteration(model, batch_for(cfg))
    greedy = plan_trace(t, mode="bilevel", pseudo="skyline", solver="greedy")
    # CP-SAT never makes it worse (with enough time it reaches the bound here: x1.0)
    c = plan_trace(t, mode="bilevel", solver="cpsat", time_limit=2.0)
    assert c.peak_bytes <= greedy.peak_bytes


def test_cpsat_named_without_ortools_is_refused(monkeypatch):
    """``solver cpsat`` without OR-Tools is an error naming the extra; ``auto`` keeps the greedy plan."""
    from megatron_lc.planning.solver import dsa

    monkeypatch.setattr(dsa, "have_ortools", lambda: False)
    t = random_trace(20, 0)
    with pytest.raises(PlanError, match=r"solver cpsat needs OR-Tools.*megatron_lc\[planning\]"):
        plan_trace(t, mode="flat", solver="cpsat")
    plan = plan_trace(t, mode="flat", solver="auto")
    plan.validate(t)
    assert plan.solver.startswith("greedy")


def test_synthetic_llama_traces_plan_to_the_bound():
    c = LlamaShape.llama3_8b(seq=4096)
    layer = llama_layer_trace(c)
    assert {b.phase for b in layer.blocks()} == {"fwd", "bwd"}
    it = llama_iteration_trace(c, num_layers=4, mlp_chunks=2, head_chunks=2, recompute=True)
    plan = plan_trace(it, time_limit=3.0)
    assert plan.levels["distinct_blocks"] == 2
    assert plan.peak_bytes <= 1.01 * plan.lower_bound_bytes


def test_cli_writes_validated_plan_and_plot(tmp_path, capsys):
    from tools.plan_memory import main

    t = random_trace(8, 0, layers=2)
    tp = str(tmp_path / "t.jsonl")
    t.dump(tp)
    out, png = str(tmp_path / "plan.json"), str(tmp_path / "plan.png")
    assert main([tp, "--out", out, "--plot", png, "--time-limit", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    plan = Plan.load(out)
    plan.validate(Trace.load(tp))
    assert summary["peak_bytes"] == plan.peak_bytes and summary["cachesim_reserved_bytes"] >= plan.peak_bytes
    assert open(png, "rb").read(4) == b"\x89PNG"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"op": "free", "id": 3, "size": 8}\n')
    assert main([str(bad), "--out", out]) == 2
    assert "free of unknown id 3" in capsys.readouterr().err
