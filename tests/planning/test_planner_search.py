"""The exact search over canonical placements (planning/solver/placement_search.py, sections.py, capacity.py) on both
backends,
the pure-Python search and its C twin (native.py, csrc/dsa_search.c; skipped with the reason when it cannot be
built): answers checked against hand instances and the big-M MIP, every plan validated, the capacity mode's three
answers, the decomposition, MiniMalloc's published hard instances solved at its capacity, and the two backends
trying the very same nodes."""
import csv
import json
import os
import random

import numpy as np
import pytest

from megatron_lc.planning.solver import native
from megatron_lc.planning.solver.capacity import minimize
from megatron_lc.planning.solver.mip import mip
from megatron_lc.planning.planner import plan_capacity, plan_trace
from megatron_lc.planning.solver.placement_search import FEASIBLE, INFEASIBLE, UNDECIDED, fit
from megatron_lc.planning.solver.sections import prepare
from megatron_lc.planning.solver.rects import Rects, best_greedy, validate
from megatron_lc.planning.trace import Trace

DATA = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "bench", "data",
                    "minimalloc_challenging")


@pytest.fixture(params=["python", "native"])
def backend(request, monkeypatch):
    """Runs a test once per search backend; ``fit``'s default ("auto") follows the environment variable."""
    if request.param == "native" and native.load() is None:
        pytest.skip(f"the native search core cannot be built here: {native.why_not()}")
    monkeypatch.setenv(native.ENV, "0" if request.param == "python" else "1")
    return request.param


def check(inst: Rects, offsets, capacity):
    """No two time-overlapping rectangles share an address; everything (background included) under capacity."""
    assert inst.peak(offsets) <= capacity
    validate(list(inst.item), inst.height, inst.start, inst.end, offsets[inst.item], capacity)


def csv_rects(path) -> Rects:
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return Rects.flat(*(np.array([int(r[k]) for r in rows]) for k in ("size", "lower", "upper")))


def test_minimalloc_readme_example(backend):
    # MiniMalloc's README input: b1 [0,3) 4, b2 [3,9) 4, b3 [0,9) 4, b4 [9,21) 4, b5 [0,21) 4; fits in 12
    inst = Rects.flat([4, 4, 4, 4, 4], [0, 3, 0, 9, 0], [3, 9, 9, 21, 21])
    r = fit(inst, 12)
    assert r.status == FEASIBLE
    check(inst, r.offsets, 12)
    assert fit(inst, 11).status == INFEASIBLE  # the max-live bound is 12


def test_tight_instance_greedy_misses(backend):
    # measured: every greedy order peaks at 9, the bound 8 is reachable (MIP agrees)
    inst = Rects.flat([3, 2, 4, 3], [5, 5, 0, 3], [9, 6, 4, 6])
    assert inst.lower_bound() == 8 and best_greedy(inst)[1] == 9
    r = fit(inst, 8)
    assert r.status == FEASIBLE
    check(inst, r.offsets, 8)
    off, peak, status, info = minimize(inst, lower_bound=8, best=best_greedy(inst)[:2], time_limit=5)
    assert (peak, status) == (8, "optimal")


def random_instance(seed):
    rng = random.Random(seed)
    n = rng.randrange(3, 9)
    s = [rng.randrange(1, 6) for _ in range(n)]
    a = [rng.randrange(0, 10) for _ in range(n)]
    b = [x + rng.randrange(1, 6) for x in a]
    if seed % 3:
        return Rects.flat(s, a, b)
    # a rigid shape (item 0 gets a second rectangle after its first) and a background, as the bi-level plan has
    item, st, en, h = list(range(n)) + [0], a + [b[0]], b + [b[0] + 3], s + [rng.randrange(1, 6)]
    bg = np.array([rng.randrange(0, 3) for _ in range(max(en) + 1)])
    return Rects(item, st, en, h, n, background=bg)


def medium_instance(seed):
    """12 buffers on 30 time steps (every fourth with two skylines and a background): tight at the bound, where
    the backjumping runs pass frames by."""
    rng = random.Random(seed)
    n = 12
    s = [rng.randrange(1, 9) for _ in range(n)]
    a = [rng.randrange(0, 30) for _ in range(n)]
    b = [x + rng.randrange(1, 12) for x in a]
    if seed % 4:
        return Rects.flat(s, a, b)
    item, st, en = list(range(n)) + [0, 1], a + [b[0], b[1]], b + [b[0] + 3, b[1] + 2]
    h = s + [rng.randrange(1, 6), rng.randrange(1, 6)]
    return Rects(item, st, en, h, n, background=np.array([rng.randrange(0, 3) for _ in range(max(en) + 1)]))


@pytest.mark.parametrize("seed", range(24))
def test_agrees_with_the_mip(seed, backend):
    """fit(optimum) finds a valid plan, fit(optimum - 1) proves there is none; the optimum from the big-M MIP."""
    inst = random_instance(seed)
    off, peak, _ = best_greedy(inst)
    _, opt, st = mip(inst, lower_bound=inst.lower_bound(), upper_bound=peak, time_limit=20)
    assert st == "optimal"
    r = fit(inst, opt)
    assert r.status == FEASIBLE
    check(inst, r.offsets, opt)
    assert fit(inst, opt - 1).status == INFEASIBLE
    off2, peak2, status, _ = minimize(inst, lower_bound=inst.lower_bound(), best=(off, peak), time_limit=5)
    assert (peak2, status) == (opt, "optimal")
    check(inst, off2, peak2)


def test_sections_and_decomposition(backend):
    # a [0,4) b [1,2) c [3,6): sections {a,b} {a,c}; {c} before 6 is no section (it lies in {a,c}); d [8,10),
    # e [9,11) live after a gap: a second partition with the one section {d,e}
    inst = Rects.flat([2, 1, 3, 1, 1], [0, 1, 3, 8, 9], [4, 2, 6, 10, 11])
    p = prepare(inst)
    assert p.S == 3 and p.span == [(0, 2), (0, 1), (1, 2), (2, 3), (2, 3)]
    assert p.total.tolist() == [3, 5, 2] and p.cuts.tolist() == [1, 0]
    assert [sorted(g.tolist()) for g, _, _ in p.partitions] == [[0, 1, 2], [3, 4]]
    assert dict(zip(*p.adj[0])) == {1: 2, 2: 2}
    assert p.byfirst.tolist() == [0, 1, 2, 3, 4] and p.pf.tolist() == [0, 2, 3, 5]
    # lifetime and area in time units (a 4 and 8, b 1 and 1, c 3 and 9); events counted in sections (starts and
    # ends per section: 3, 3)
    assert p.width.tolist()[:3] == [4, 1, 3] and p.area.tolist()[:3] == [8, 1, 9] and p.events.tolist()[:3] == [6, 3, 3]
    # preorders: T is the largest of the given per-section totals (the bytes still unplaced when a part starts);
    # ties go by canonical position (first section, last section, height descending)
    items = np.array([0, 1, 2])
    assert p.rank("T", items, p.total).tolist() == [0, 2, 1]  # T: a 5, b 3, c 5 (a before c: first section)
    assert p.rank("T", items, np.array([1, 3, 2])).tolist() == [0, 2, 1]  # T: a 3, b 1, c 3
    assert p.rank("T", items, np.array([3, 1, 2])).tolist() == [1, 0, 2]  # T: a 3, b 3 (b first: ends first), c 1
    assert p.rank("WT", items, np.array([1, 3, 2])).tolist() == [0, 2, 1]  # W: a 4, c 3, b 1
    assert p.rank("Z", items, p.total).tolist() == [1, 2, 0]  # height: c 3, a 2, b 1
    r = fit(inst, 5)
    assert r.status == FEASIBLE
    check(inst, r.offsets, 5)


def test_sections_read_only_the_overlap_order():
    """The same instance with times stretched, compressed or ids permuted prepares to the same sections, cuts and
    events (up to the renumbering), ties in a canonical order, never by id; only lifetime and area are in the
    instance's time unit (the planner hands the search runs of mallocs and frees)."""
    base = Rects.flat([2, 1, 3, 1, 1], [0, 1, 3, 8, 9], [4, 2, 6, 10, 11])
    stretched = Rects.flat([2, 1, 3, 1, 1], [0, 10, 37, 1000, 1001], [40, 20, 100, 1002, 5000])
    p, q = prepare(base), prepare(stretched)
    for k in ("total", "cuts", "events", "first", "span", "partitions"):
        assert str(getattr(p, k)) == str(getattr(q, k)), k
    perm = np.array([3, 0, 4, 2, 1])  # item k of the permuted instance is item perm[k] of base
    permuted = Rects.flat(*(np.array(v)[perm] for v in ([2, 1, 3, 1, 1], [0, 1, 3, 8, 9], [4, 2, 6, 10, 11])))
    r = prepare(permuted)
    assert r.width.tolist() == p.width[perm].tolist() and r.total.tolist() == p.total.tolist()
    # in canonical order the items are the same (d and e, identical, may trade places)
    canonical = [[(q.span[i], q.height[i]) for i in np.argsort(q.canon)] for q in (r, p)]
    assert canonical[0] == canonical[1]


def test_challenging_instance_at_capacity(backend):
    """MiniMalloc's published hard instance F (296 buffers) at its capacity 1,048,576: greedy is 1.20x above."""
    inst = csv_rects(os.path.join(DATA, "F.1048576.csv"))
    assert best_greedy(inst)[1] > 1048576
    r = fit(inst, 1048576, time_limit=20, backend=backend)
    assert r.status == FEASIBLE
    check(inst, r.offsets, 1048576)


@pytest.mark.parametrize("name", "ABCDEFGHIJK")
def test_native_solves_the_challenging_set_at_capacity(name):
    """The C core at MiniMalloc's capacity on the CSV's own times, 10 s each: measured 601-32,893 nodes, at most
    0.08 s here (the planner's order-only instance of every encoding: tests/planning/test_planner_encodings.py). H and I
    need
    the parts of a decomposition preordered anew."""
    if native.load() is None:
        pytest.skip(f"the native search core cannot be built here: {native.why_not()}")
    inst = csv_rects(os.path.join(DATA, f"{name}.1048576.csv"))
    r = fit(inst, 1048576, time_limit=10, backend="native")
    assert r.status == FEASIBLE
    check(inst, r.offsets, 1048576)


@pytest.mark.parametrize("seed", range(30))
def test_backends_try_the_same_nodes(seed):
    """Same answer, same plan, same node count from Python and C, at the optimum and around it: the C core is a
    twin of the Python search, not another heuristic."""
    if native.load() is None:
        pytest.skip(f"the native search core cannot be built here: {native.why_not()}")
    for inst, caps in ((random_instance(seed), 4), (medium_instance(seed), 3)):
        for cap in range(inst.lower_bound(), inst.lower_bound() + caps):
            a, b = fit(inst, cap, backend="python"), fit(inst, cap, backend="native")
            assert (a.status, a.nodes) == (b.status, b.nodes)
            assert a.offsets is None or (a.offsets == b.offsets).all()
    if seed in (0, 1):  # published instances, each decided by a backjumping run
        name, expect = [("J", 601), ("H", 1130)][seed]
        inst = csv_rects(os.path.join(DATA, f"{name}.1048576.csv"))
        a, b = fit(inst, 1048576, backend="python"), fit(inst, 1048576, backend="native")
        assert (a.status, a.nodes) == (b.status, b.nodes) == (FEASIBLE, expect) and (a.offsets == b.offsets).all()


def test_forced_python_and_a_failed_build(monkeypatch, tmp_path):
    monkeypatch.setenv(native.ENV, "0")
    assert native.load() is None and native.why_not() == f"{native.ENV}=0"
    inst = Rects.flat([4, 4, 4, 4, 4], [0, 3, 0, 9, 0], [3, 9, 9, 21, 21])
    with pytest.raises(native.NativeUnavailable):
        fit(inst, 12, backend="native")
    assert fit(inst, 12).status == FEASIBLE  # auto: the Python search
    bad = tmp_path / "bad.c"
    bad.write_text("int dsa_fit( {")
    with pytest.raises(native.NativeUnavailable, match="failed"):
        native.build(str(bad), str(tmp_path))


def test_capacity_mode_three_answers(tmp_path, capsys, backend):
    from tools.plan_memory import main

    t = Trace.load_csv(os.path.join(DATA, "A.1048576.csv"))
    lb = Rects.flat(*(np.array(v) for v in zip(*[(r.size, r.start, r.end) for r in t.requests()]))).lower_bound()
    out = str(tmp_path / "plan.json")
    ans, plan = plan_capacity(t, 2 * lb, alignment=1)  # greedy fits
    assert ans == FEASIBLE and plan.peak_bytes <= 2 * lb
    plan.validate(t)
    assert plan_capacity(t, lb - 1, alignment=1) == (INFEASIBLE, None)  # below the bound
    # K at its bound: greedy does not fit and 50 ms of search decide nothing (the C core needs 76,450 nodes, ~0.3 s)
    hard = os.path.join(DATA, "K.1048576.csv")
    assert plan_capacity(Trace.load_csv(hard), 1048576, time_limit=0.05, alignment=1) == (UNDECIDED, None)
    csv_path = os.path.join(DATA, "A.1048576.csv")
    assert main([csv_path, "--out", out, "--alignment", "1", "--capacity", str(2 * lb)]) == 0
    assert json.loads(capsys.readouterr().out)["answer"] == "feasible"
    assert main([csv_path, "--out", out, "--alignment", "1", "--capacity", str(lb - 1)]) == 1
    assert json.loads(capsys.readouterr().out)["answer"] == "infeasible"
    assert main([hard, "--out", out, "--alignment", "1", "--capacity", "1048576", "--time-limit", "0.05"]) == 3
    assert json.loads(capsys.readouterr().out)["answer"] == "undecided"


def test_auto_runs_the_search_when_greedy_is_above_the_bound():
    from tests.planning.test_planner import random_trace

    t = random_trace(60, 5)  # greedy 7% above the bound (measured)
    g = plan_trace(t, mode="flat", solver="greedy")
    plan = plan_trace(t, mode="flat", solver="search", time_limit=5)
    assert g.peak_bytes > g.lower_bound_bytes and "+search" in plan.solver
    assert plan.peak_bytes == plan.lower_bound_bytes and plan.status == "optimal"
    plan.validate(t)


def test_csv_trace_keeps_its_times():
    """MiniMalloc's CSV read as a trace keeps the buffers' own lifetimes (the preorders use them), same conflicts."""
    t = Trace.from_intervals([(1, 0, 10, 4), (2, 10, 30, 4), (3, 5, 12, 2)])
    assert [(r.id, r.start, r.end) for r in t.requests()] == [(1, 0, 10), (3, 5, 12), (2, 10, 30)]
    assert [(r.start, r.end) for r in t.subset([2]).requests()] == [(10, 30)]
    rows = list(csv.DictReader(open(os.path.join(DATA, "F.1048576.csv"))))
    reqs = {r.id: r for r in Trace.load_csv(os.path.join(DATA, "F.1048576.csv")).requests()}
    assert all((reqs[int(r["id"])].start, reqs[int(r["id"])].end) == (int(r["lower"]), int(r["upper"])) for r in rows)
