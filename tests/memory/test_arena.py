"""Static arena: framework buffers as views of one planned buffer; memory.plan off | auto | plan.json."""
import logging
import os

import pytest
import torch

from megatron_lc.config import ConfigError
from megatron_lc.memory.arena import Arena, ArenaLayout, PlannedArena, Slot
from megatron_lc.parallel.topology import Topology
from megatron_lc.planning.capture.record import capture_iteration
from megatron_lc.planning.planner import plan_trace
from megatron_lc.planning.memory_plan import layout_from_plan
from megatron_lc.training.loop import Trainer
from tests.support.arena_toy import with_toy_mlp
from tests.support.parity import GRAD_ATOL, LOSS_RTOL, batch_for, build, reference_loss_and_grads, small_config


def test_default_arena_allocates_and_counts():
    a = Arena()
    x = a.buffer("t", (4, 8), torch.float32)
    assert x.shape == (4, 8) and a.stats.fresh_allocations == 1
    p1 = a.buffer("p", (16,), torch.float32, persistent=True)
    p2 = a.buffer("p", (16,), torch.float32, persistent=True)
    assert p1 is p2 and a.stats.fresh_allocations == 2


def _layout():
    return ArenaLayout(4096, {("a", 0): Slot(0, 1024), ("a", 1): Slot(1024, 1024), ("b", 0): Slot(0, 2048)},
                       {"p": Slot(3072, 1024)})


def test_planned_arena_same_addresses_every_iteration():
    ar = PlannedArena(_layout())
    seen = []
    for _ in range(3):
        ar.begin_iteration()
        x = ar.buffer("a", (256,), torch.float32)
        y = ar.buffer("a", (16, 16), torch.float32)
        seen.append((x.data_ptr() - ar.base.data_ptr(), y.data_ptr() - ar.base.data_ptr()))
        del x, y
        z = ar.buffer("b", (512,), torch.float32)  # reuses a's bytes: a's buffers are dead
        assert z.data_ptr() == ar.base.data_ptr()
        del z
    assert seen == [(0, 1024)] * 3
    assert ar.stats.fresh_allocations == 0 and ar.stats.planned == 9
    p = ar.buffer("p", (256,), torch.float32, persistent=True)
    assert p.data_ptr() - ar.base.data_ptr() == 3072 and ar.buffer("p", (256,), torch.float32, persistent=True) is p


def test_planned_arena_falls_back_on_divergence(caplog):
    ar = PlannedArena(_layout())
    with caplog.at_level(logging.WARNING, logger="megatron_lc"):
        x = ar.buffer("a", (256,), torch.float32)
        view = x[:10]  # a view keeps the slot in use even after x is dropped
        del x
        y = ar.buffer("b", (16,), torch.float32)  # b's slot overlaps the live view: fallback
        big = ar.buffer("a", (1024,), torch.float32)  # larger than planned
        unknown = ar.buffer("c", (4,), torch.float32)  # not in the plan
    assert ar.stats.fallbacks == 3 and ar.stats.fresh_allocations == 3
    assert "still in use" in caplog.text and "> planned 1024" in caplog.text and "not planned" in caplog.text
    assert not (ar.base.data_ptr() <= y.data_ptr() < ar.base.data_ptr() + 4096)
    del view, big, unknown


def _toy_model(cfg):
    return build(cfg, adjust_spec=with_toy_mlp)


def _step(model, b):
    model.zero_grad(set_to_none=True)
    loss = (model(b["tokens"], b["position_ids"], b["labels"]) * b["loss_mask"]).sum() / b["loss_mask"].sum()
    loss.backward()
    return float(loss), {n.replace("mlp.mlp.", "mlp."): p.grad.clone() for n, p in model.named_parameters()}


def test_toy_framework_buffers_from_the_plan_are_exact():
    cfg = small_config(["model.num_layers=2"])
    b = batch_for(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, b)
    model, ctx = _toy_model(cfg)
    off_loss, off_grads = _step(model, b)
    trace = capture_iteration(model, b, ctx.arena)
    tags = [e.tag for e in trace.events if e.tag]
    assert tags.count("toy.fc1") == 4 and tags.count("toy.fc1.bwd") == 4  # 2 layers x 2 chunks, fwd and bwd
    plan = plan_trace(trace, solver="greedy")
    arena = PlannedArena(layout_from_plan(plan))
    ctx.arena.install(arena)
    for _ in range(2):
        loss, grads = _step(model, b)
        # same ops on the same values, only the buffers' addresses differ: bitwise equal to the unplanned run
        assert loss == off_loss and all(torch.equal(grads[k], off_grads[k]) for k in grads)
    assert arena.stats.fresh_allocations == 0 and arena.stats.planned == 16 + 1  # + the persistent buffer, once
    lay = layout_from_plan(plan)
    pers = lay.persistent["toy.persist"]  # static region after the planned slots, one 512-byte granule
    assert pers.offset >= max(sl.offset + sl.nbytes for sl in lay.slots.values()) and pers.nbytes == 512
    # the chunked toy against the plain model: the project's contract (loss 1e-5 relative, grads 1e-4; fp32
    # chunking only reorders sums of <= 64 terms, error ~1e-7)
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads) <= GRAD_ATOL


def _train(overrides, tmp_path=None, toy=False):
    cfg = small_config(["train.train_iters=3", "train.lr=1e-3", "memory.plan_time_limit=1"] + overrides)
    t = Trainer(cfg, Topology(), torch.device("cpu"), adjust_spec=with_toy_mlp if toy else None)
    state = t.train()
    return state.losses, t


@pytest.mark.parametrize("toy", [False, True])
def test_training_with_plan_auto_gives_the_same_losses(tmp_path, toy):
    off, _ = _train(["memory.plan=off"], toy=toy)
    save = str(tmp_path / "run")
    auto, trainer = _train(["memory.plan=auto", f"checkpoint.save={save}"], toy=toy)
    assert auto == off  # profiling restores the RNG and clears the grads; planned buffers hold the same values
    stats = trainer.arena.stats
    assert stats.fresh_allocations == 0  # after the plan is installed (before step 1), nothing is allocated fresh
    assert stats.planned == (3 * 8 + 1 if toy else 0)  # 3 steps x (2 layers x 2 chunks x fwd+bwd) + persistent
    plan_path = os.path.join(save, "memory_plan_rank0.json")
    assert os.path.isfile(plan_path) and os.path.isfile(os.path.join(save, "memory_trace_rank0.jsonl"))
    again, trainer = _train([f"memory.plan={plan_path}"], toy=toy)  # the written plan, loaded from the file
    assert again == off and trainer.arena.stats.fresh_allocations == 0


def test_bad_plan_settings_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="must be 'off', 'auto' or an existing plan JSON file"):
        Trainer(small_config(["memory.plan=/nonexistent/plan.json"]), Topology())
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read plan"):
        Trainer(small_config([f"memory.plan={bad}"]), Topology())


def test_plan_replay_allocator_host_twin():
    """The C replay behind the GPU pluggable allocator, built with host malloc, driven with a trace's requests."""
    import shutil

    from megatron_lc.planning.replay_cuda import PlanReplay
    from tests.planning.test_planner import random_trace

    if shutil.which("gcc") is None:
        pytest.skip("no C compiler")
    t = random_trace(30, 2)
    plan = plan_trace(t, mode="flat", solver="greedy")
    rp = PlanReplay.host_twin(plan)
    base = rp.base()
    outside = rp.malloc(100)  # before any iteration: the backend serves it
    for _ in range(2):
        rp.begin_iteration()
        ptr = {}
        for e in t.events:
            if e.op == "malloc":
                ptr[e.id] = rp.malloc(e.size)
                assert ptr[e.id] - base == plan.offsets[e.id]  # exactly the planned address, every iteration
            else:
                rp.free(ptr.pop(e.id))
        for p in ptr.values():  # tensors live to the end of the iteration
            rp.free(p)
    n = len(plan.order)
    assert rp.stats() == {"hits": 2 * n, "fallbacks": 0, "outside_iteration": 1, "live_planned": 0}
    rp.free(outside)
    # divergence: the third request asks for more than planned -> it and the rest of the iteration fall back
    rp.begin_iteration()
    sizes = [e.size for e in t.events if e.op == "malloc"]
    got = [rp.malloc(s + (4096 if k == 2 else 0)) for k, s in enumerate(sizes[:5])]
    assert [g - base for g in got[:2]] == [plan.offsets[i] for i in plan.order[:2]]
    assert all(not (base <= g < base + plan.peak_bytes) for g in got[2:])
    assert rp.stats()["fallbacks"] == 3
    for g in got:
        rp.free(g)


def test_fpdt_chunk_buffers_come_from_the_arena():
    """FPDT (P=2 Ulysses ranks, u=4 chunks, offload on): with memory.plan=auto its chunk buffers (fetched kv/q
    chunks, dk/dv accumulators) are arena views, no fresh allocation after the plan, same losses as plan=off."""
    from tests.dist_cases import plan as dist_cases_plan
    from tests.support.dist import run_dist

    off = run_dist(2, dist_cases_plan.fpdt_train, ["memory.plan=off"])
    auto = run_dist(2, dist_cases_plan.fpdt_train, ["memory.plan=auto"])
    for r in range(2):
        assert auto[r][0] == off[r][0]  # bitwise: the buffers hold the same values at other addresses
        stats, size = auto[r][1], auto[r][2]
        assert stats["fresh_allocations"] == 0 and stats["fallbacks"] == 0
        assert stats["planned"] > 0 and {"fpdt.fetch_kv", "fpdt.chunk"} <= set(stats["by_tag"])
        assert size > 0
