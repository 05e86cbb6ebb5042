"""Trace format, validation errors, and capture from the tiny model (dispatch-level tracer)."""
import json

import pytest
import torch

from megatron_lc.memory.recompute import with_layer_checkpoint
from megatron_lc.planning.capture.record import capture_iteration, capture_layer, trace_from_snapshot
from megatron_lc.planning.trace import Event, Trace, TraceError, max_live_bytes
from tests.support.parity import batch_for, build, small_config


def _write(tmp_path, lines):
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return str(p)


def test_round_trip_and_intervals(tmp_path):
    # the module docstring's example: 1: [0, 2), 2: [1, 4) never freed, 3: [3, 4)
    t = Trace([Event("malloc", 1, 100, 0, "fwd"), Event("malloc", 2, 50, 0, "fwd"), Event("free", 1, 100, 0, "fwd"),
               Event("malloc", 3, 70, tag="x.buf")])
    p = str(tmp_path / "t.jsonl")
    t.dump(p)
    t2 = Trace.load(p)
    assert [e.to_json() for e in t2.events] == [e.to_json() for e in t.events]
    assert [(r.id, r.start, r.end, r.tag) for r in t2.requests()] == [(1, 0, 2, None), (2, 1, 4, None),
                                                                      (3, 3, 4, "x.buf")]
    assert max_live_bytes(t2.requests()) == 150  # 1 and 2 live together; 3 replaces 1
    assert [(b.layer, b.phase, b.start, b.end) for b in t2.blocks()] == [(0, "fwd", 0, 3)]


@pytest.mark.parametrize("lines,msg", [
    ([{"op": "free", "id": 1, "size": 8}, {"op": "malloc", "id": 1, "size": 8}],
     "line 1: free of id 1 before its malloc at line 2"),
    ([{"op": "malloc", "id": 1, "size": 8}, {"op": "free", "id": 2, "size": 8}], "line 2: free of unknown id 2"),
    ([{"op": "malloc", "id": 1, "size": 8}, {"op": "free", "id": 1, "size": 8}, {"op": "free", "id": 1, "size": 8}],
     "line 3: double free of id 1 (already freed at line 2)"),
    ([{"op": "malloc", "id": 1, "size": 8}, {"op": "malloc", "id": 1, "size": 8}], "line 2: id 1 allocated twice"),
    ([{"op": "malloc", "id": 1, "size": 8}, {"op": "free", "id": 1, "size": 16}],
     "says 16 bytes, its malloc at line 1 said 8"),
    ([{"op": "alloc", "id": 1, "size": 8}], "line 1: op 'alloc' is not"),
    ([{"op": "malloc", "id": 1}], "line 1: 'size' must be an integer"),
    (["{not json"], "line 1: not JSON"),
    ([{"op": "malloc", "id": 1, "size": -8}], "negative size"),
    ([{"op": "malloc", "id": 1, "size": 8, "layer": 0}], "a layer mark needs a phase"),
    ([{"op": "malloc", "id": 1, "size": 8, "layer": 0, "phase": "fw"}], "phase 'fw' is not one of"),
    ([{"op": "malloc", "id": 1, "size": 8, "colour": 1}], "unknown keys ['colour']"),
])
def test_corrupt_traces_get_clear_errors(tmp_path, lines, msg):
    with pytest.raises(TraceError) as e:
        Trace.load(_write(tmp_path, lines))
    assert msg in str(e.value)


def _tiny(layers, recompute=False, overrides=()):
    cfg = small_config([f"model.num_layers={layers}", *overrides])
    # recompute: full activation recompute of each layer (torch's checkpoint): forward re-run in backward
    model, _ = build(cfg, adjust_spec=with_layer_checkpoint if recompute else None)
    return cfg, model


@pytest.mark.parametrize("layers", [1, 4])
def test_capture_tiny_model_marks_blocks(layers):
    cfg, model = _tiny(layers)
    trace = capture_iteration(model, batch_for(cfg))
    trace.validate()
    blocks = trace.blocks()
    # one forward and one backward block per layer, forward in order, backward in reverse
    assert [(b.layer, b.phase) for b in blocks] == [(i, "fwd") for i in range(layers)] + \
        [(i, "bwd") for i in reversed(range(layers))]
    # gradients are allocated and never freed: one per parameter
    never_freed = {r.id for r in trace.requests() if r.end == len(trace.events)}
    assert len(never_freed) >= sum(1 for _ in model.parameters())
    # layers are identical: every forward block allocates the same sizes in the same order
    sig = [tuple(e.size for e in trace.events[b.start:b.end] if e.op == "malloc") for b in blocks if b.phase == "fwd"]
    assert len(set(sig)) == 1


def test_capture_with_recompute_marks_recomputation_as_backward():
    cfg, model = _tiny(2, recompute=True)
    trace = capture_iteration(model, batch_for(cfg))
    blocks = trace.blocks()
    assert [(b.layer, b.phase) for b in blocks] == [(0, "fwd"), (1, "fwd"), (1, "bwd"), (0, "bwd")]
    fwd = [e for e in trace.events if e.layer == 1 and e.phase == "fwd" and e.op == "malloc"]
    bwd = [e for e in trace.events if e.layer == 1 and e.phase == "bwd" and e.op == "malloc"]
    assert len(bwd) > len(fwd)  # the recomputed forward is inside the backward block


def test_capture_layer_alone():
    cfg, model = _tiny(1)
    s, b, h = cfg.data.seq_length, 2, cfg.model.hidden_size
    pos = torch.arange(s).unsqueeze(1).expand(s, b)
    trace = capture_layer(model.layers[0], torch.randn(s, b, h), model.rotary(pos))
    assert {(e.layer, e.phase) for e in trace.events} == {(0, "fwd"), (0, "bwd")}


def test_snapshot_adapter_on_a_synthetic_snapshot():
    snap = {"device_traces": [[
        {"action": "segment_alloc", "addr": 0, "size": 2 << 20, "time_us": 1},
        {"action": "alloc", "addr": 0, "size": 512, "time_us": 2},
        {"action": "alloc", "addr": 512, "size": 1024, "time_us": 5},
        {"action": "free_requested", "addr": 0, "size": 512, "time_us": 6},
        {"action": "free_completed", "addr": 0, "size": 512, "time_us": 6},
        {"action": "free_completed", "addr": 4096, "size": 512, "time_us": 7},  # allocated before recording
        {"action": "alloc", "addr": 0, "size": 512, "time_us": 8},
    ]]}
    t = trace_from_snapshot(snap, marks=[(4, 0, "fwd"), (7, None, None)])
    assert [(e.op, e.id, e.size, e.layer) for e in t.events] == [
        ("malloc", 0, 512, None), ("malloc", 1, 1024, 0), ("free", 0, 512, 0), ("malloc", 2, 512, None)]
