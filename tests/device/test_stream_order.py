"""The stream-order check (``device.stream_check.StreamCheck``): the offload techniques train under it with no
violation and the same losses, and faults planted in their stream ordering -- each invisible to the ordinary CPU run,
where copies are synchronous and streams are names -- are reported with the buffer and both sites.

Losses are compared bitwise: the check runs the CPU twin's work unchanged (only the host pool's block placement
could differ, and the pool places blocks alike whatever its events say)."""
from __future__ import annotations

import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.attention.fpdt.buffers import FPDTBuffers
from megatron_lc.config import load_config, resolve_layout
from megatron_lc.device import BufferAccount, DeviceAdapter, HostPool, StreamCheck, has_values, use_adapter
from megatron_lc.memory.arena import Arena
from megatron_lc.memory.memo.runtime import MemoRuntime
from megatron_lc.parallel.topology import Topology
from megatron_lc.rehearsal.rank import rehearsal_config, stand_in_execution
from megatron_lc.rehearsal.world import fake_world
from megatron_lc.training.loop import Trainer
from tests.dist_cases.offload import one_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=32", "data.mock_data=true", "data.prepare_demo_data=false", "train.device=cpu",
        "train.micro_batch_size=2", "train.global_batch_size=2", "train.train_iters=2", "train.lr=1e-3",
        "train.lr_warmup_iters=0", "checkpoint.save=null", "logging.metrics_file=/dev/null",
        "logging.log_interval=100", "memory.plan_time_limit=1"]
MEMO = ["memory.activation_offload=memo"]  # 4 layers: 0, 1 swapped through the host
FPDT = ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8", "memory.fpdt_offload=true"]  # P = 1, u = 4
CKPT = ["memory.activation_offload=checkpoints"]
TECHNIQUES = {
    "memo-alpha-0.25": MEMO + ["memory.offload_fraction=0.25"],
    "memo-alpha-1": MEMO + ["memory.offload_fraction=1"],
    "fpdt-u4-offload": FPDT,
    "checkpoints": CKPT,
    "checkpoints-chunked": CKPT + ["memory.layer_chunk_size=8"],
    "fpdt-plan-arena": FPDT + ["memory.plan=auto"],  # FPDT's chunk buffers as arena blocks
}
_plain: dict = {}


def train(name: str) -> list:
    return Trainer(load_config(None, TINY + TECHNIQUES[name]), Topology()).train().losses


def plain_losses(name: str) -> list:
    """The ordinary CPU run's losses (no check, no fault), once per technique."""
    if name not in _plain:
        _plain[name] = train(name)
    return _plain[name]


@pytest.mark.parametrize("name", TECHNIQUES)
def test_techniques_train_with_no_violation_and_the_same_losses(name):
    with StreamCheck() as check:
        losses = train(name)
    assert not check.violations, check.report()
    offload, prefetch = check.copy_streams()
    assert offload.clock > 0 and prefetch.clock > 0  # copies ran on both side streams: not a vacuous pass
    assert losses == plain_losses(name)


# ---- planted faults --------------------------------------------------------------------------------------------------
def drop_wait(monkeypatch, caller: str) -> None:
    """Plant a missing wait: ``wait_event`` called from a function named ``caller`` does nothing, on the CPU twin
    and under the check alike."""
    for cls in (DeviceAdapter, StreamCheck):
        def wait_event(self, event, stream=None, _orig=cls.wait_event):
            if sys._getframe(1).f_code.co_name != caller:
                _orig(self, event, stream)
        monkeypatch.setattr(cls, "wait_event", wait_event)


# (technique, plant, expected kind, the earlier access's file and function, the racing access's file)
FAULTS = {
    "memo-prefetch-not-waited": ("memo-alpha-0.25", "ensure_resident", "read before its write's event",
                                 "memory/memo/runtime.py", "_fetch", "megatron_lc/"),
    "checkpoints-prefetch-not-waited": ("checkpoints", "fetch", "read before its write's event",
                                        "memory/checkpoint_offload.py", "prefetch", "megatron_lc/model/"),
    "fpdt-fetch-not-waited": ("fpdt-u4-offload", "wait", "read before its write's event",
                              "attention/fpdt/buffers.py", "fetch", "megatron_lc/"),
    "memo-rounding-buffer-reused-before-offload": ("memo-alpha-1", "new_slot", "overwritten while read",
                                                   "memory/memo/runtime.py", "after_forward",
                                                   "megatron_lc/memory/memo/slots.py"),
    "arena-block-reused-before-side-stream": ("fpdt-plan-arena", "_wait_pending", "overwritten while read",
                                             "attention/fpdt/buffers.py", "to_host",
                                             "megatron_lc/attention/fpdt/buffers.py"),
    "fpdt-source-freed-without-record-stream": ("fpdt-u4-offload", "record_stream", "freed while in use",
                                                "attention/fpdt/buffers.py", "to_host",
                                                "megatron_lc/attention/fpdt/pipeline.py"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_planted_fault_is_reported_with_both_sites_and_passes_the_cpu_run(monkeypatch, fault):
    name, plant, kind, first_file, first_fn, second_prefix = FAULTS[fault]
    plain = plain_losses(name)
    if plant == "record_stream":  # FPDT stops declaring its copies' sources to the allocator and the arena
        monkeypatch.setattr(FPDTBuffers, "_record_stream", lambda self, t, stream: None)
    else:
        drop_wait(monkeypatch, plant)
    assert train(name) == plain  # the ordinary CPU run does not notice
    with StreamCheck() as check:
        assert train(name) == plain
    hits = [v for v in check.violations if v.kind == kind and v.first.file.endswith(first_file)
            and v.first.function == first_fn and v.second.file.startswith(second_prefix)]
    assert hits, check.report()
    line = str(hits[0])
    assert str(hits[0].first) in line and str(hits[0].second) in line and "bytes [" in line, line


def test_host_block_given_back_without_its_event():
    """FPDT's buffers, one host block: park a chunk, fetch it back (the prefetch stream reads the block), give the
    block back before the compute stream waited for that fetch, park another chunk (the offload stream writes the
    same block). Given back with the fetch's event, the pool waits for it before handing the block out again; without,
    the offload stream overwrites what the prefetch stream may still read. The CPU twin sees no difference."""
    def run(adapter, plant: bool):
        pool = HostPool()
        pool.reserve("fpdt", HostPool.block_bytes((64,), torch.float32))  # exactly one block
        with use_adapter(adapter):
            bufs = FPDTBuffers(torch.device("cpu"), BufferAccount(), BufferAccount(), Arena(), pool)
        if plant:
            give = pool.give
            pool.give = lambda t, after=None: give(t)
        x = torch.arange(64, dtype=torch.float32)
        h = bufs.to_host(x)
        fetched = bufs.fetch([h], "fpdt.fetch_kv")
        bufs.drop_host(h)
        again = bufs.to_host(-x)
        assert again.host.data_ptr() == h.host.data_ptr()  # the same block
        return torch.equal(bufs.wait(fetched)[0], x)

    assert run(DeviceAdapter(torch.device("cpu")), plant=True)  # unnoticed on the CPU twin
    for plant in (False, True):
        with StreamCheck() as check:
            assert run(check, plant)
        assert [v.kind for v in check.violations] == (["overwritten while read"] if plant else []), check.report()
    v = check.violations[0]
    assert (v.first_stream, v.first.function, v.second_stream, v.second.function) == (
        "prefetch", "fetch", "offload", "to_host")
    assert "host buffer allocated at megatron_lc/device/host_pool.py" in v.buffer


@pytest.mark.parametrize("name", ["fpdt-u4-offload", "checkpoints"])
def test_host_blocks_given_back_without_their_event_race_nothing_in_these_users(monkeypatch, name):
    """FPDT and the host checkpoints give a block back only after the compute stream waited for the copy that read
    it, and every later copy into a block waits for the compute stream first: ``after=`` is a second guard there,
    and the check reports races, not missing guards."""
    give = HostPool.give
    monkeypatch.setattr(HostPool, "give", lambda self, t, after=None: give(self, t))
    with StreamCheck() as check:
        assert train(name) == plain_losses(name)
    assert not check.violations, check.report()


# ---- the clocks ------------------------------------------------------------------------------------------------------
def test_events_waits_synchronize_and_record_stream():
    check = StreamCheck()
    side = check.new_stream("side")

    def found():
        kinds = [v.kind for v in check.violations]
        check.violations.clear()
        check._reported.clear()
        return kinds

    with check:
        x = torch.zeros(8)  # written on the compute stream
        with check.stream(side):
            x.add_(1)
        assert found() == ["overwritten while written"]  # the side stream did not wait for the zeros
        check.wait_event(check.record_event(), side)
        with check.stream(side):
            x.add_(1)
        done = check.record_event(side)
        assert found() == [] and not done.query()  # an event is not complete by itself
        (x * 2).sum()
        assert found() == ["read before its write's event"]
        check.wait_event(done)
        (x * 3).sum()
        assert found() == []

        with check.stream(side):
            y = torch.ones(4)  # allocated (and filled) on the side stream ...
        check.wait_stream(check.compute, side)
        y.mul_(2)  # ... used on the compute stream
        check.record_stream(y, check.current_stream())
        del y
        assert found() == []  # declared: its memory is not reused before the compute stream's use ran

        z = torch.ones(4)
        check.wait_stream(side, check.compute)
        with check.stream(side):
            z.mul_(2)
        del z  # back to the compute stream's pool while the side stream may still write it
        assert found() == ["freed while in use"]

        w = torch.ones(4)
        check.wait_stream(side, check.compute)
        with check.stream(side):
            w.mul_(2)
        check.synchronize()
        assert done.query()
        del w  # the host passed everything: nothing may still use it
        assert found() == []


def test_accesses_every_stream_passed_are_forgotten():
    check = StreamCheck()
    with check:
        x = torch.zeros(1000)
        for i in range(300):
            x[i].add_(1)  # disjoint byte ranges: none covers another
        check.synchronize()  # every stream (the host included) passed them: they can race nothing
        for i in range(300, 600):
            x[i].add_(1)
        assert len(check.locate(x)[0].accesses) < 400
    assert not check.violations


def test_a_value_read_makes_the_host_pass_the_stream():
    check = StreamCheck()
    with check:
        x = torch.ones(4)
        ev = check.record_event()
        assert not ev.query()
        float(x.sum())  # .item(): the host waits for the compute stream
        assert ev.query()


# ---- fake tensors ----------------------------------------------------------------------------------------------------
def memo_layers(drop_prefetch_wait: bool):
    """Four one-tensor layers through Memo's offload runtime (layers 0, 1 swapped): forward, then backward reading
    each layer's kept tensor back from its rounding buffer."""
    rt = MemoRuntime(num_layers=4, offload=True, alpha=1.0, device=torch.device("cpu"))
    rt.size_for(4096)
    rt.allocate()
    xs = [torch.randn(32, 2, 8) for _ in range(4)]
    handles = []
    for layer, x in enumerate(xs):
        slot = rt.new_slot(layer, set())
        handles.append(slot.keep("input", x))
        rt.after_forward(slot)
    for layer in reversed(range(4)):
        slot = rt.slots[layer]
        if drop_prefetch_wait:
            rt.fetch_events.pop(id(slot), None)  # the compute stream never waits for this layer's prefetch
        rt.before_backward(slot)
        (slot.unpack(handles[layer]) * 2).sum()
    return rt


@pytest.mark.parametrize("fault", [False, True])
def test_memo_offload_under_fake_tensors(fault):
    """Under ``FakeTensorMode`` every storage has address 0: buffers are told apart by identity, so a planted missing
    wait names the rounding buffer (not the host pool, nor one buffer for all)."""
    with FakeTensorMode():
        with StreamCheck() as check:
            rt = memo_layers(drop_prefetch_wait=fault)
        assert not any(has_values(b.data) for b in rt.buffers)  # fake: no values, no addresses
    assert check.copy_streams()[1].clock > 0  # layers 0, 1 came back on the prefetch stream
    if not fault:
        assert not check.violations, check.report()
        return
    kinds = {(v.kind, v.first.function) for v in check.violations}
    assert ("read before its write's event", "_fetch") in kinds, check.report()
    assert all("allocated at megatron_lc/memory/memo/runtime.py" in v.buffer for v in check.violations)


@pytest.mark.parametrize("fault", [False, True])
def test_memo_step_as_the_rehearsal_runs_it(monkeypatch, fault):
    """The tiny Llama's step with Memo offload (alpha 0.25) as a rehearsal runs it -- fake tensors, a fake process
    group, a GPU run's execution on the stand-in device -- under the check: clean, and a dropped prefetch wait
    reported."""
    if fault:
        drop_wait(monkeypatch, "ensure_resident")
    cfg = rehearsal_config(load_config(None, TINY + TECHNIQUES["memo-alpha-0.25"]), steps=1, host_memory_gb=64.0)
    execution = stand_in_execution(cfg)
    with fake_world(0, 1, 1, execution.device):
        layout = resolve_layout(cfg, 1)
        with FakeTensorMode(), StreamCheck(execution.device) as check:
            trainer = Trainer(cfg, Topology.build(), layout=layout, execution=execution)
            trainer.reads_values = False
            trainer.train_step(0)
    assert check.copy_streams()[1].clock > 0
    kinds = {(v.kind, v.first.function) for v in check.violations}
    assert kinds == ({("read before its write's event", "_fetch")} if fault else set()), check.report()
