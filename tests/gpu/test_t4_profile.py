"""T4: one profiled training step (``torch.profiler``, after a warm-up step, in a fresh process) of the 1B Llama
(Llama-3.2-1B's shape, bf16 autocast) at 64K tokens with Memo (alpha auto) and with FPDT (P = 1, u = 8, offload),
each with MsT's chunked MLP and head (the 64K x 128K-vocab logits would not fit otherwise). From the trace: the
fraction of the host<->device copy time (``Memcpy HtoD`` / ``DtoH``) during which a compute kernel runs; at least
90% on a GPU. Dry run: the tiny model at 256 tokens (the step runs under the profiler, the CPU trace parses, no
copy kernels exist) and the overlap function on synthetic intervals."""
import json
import os
import time

import pytest

from tests.gpu import _util
from tests.gpu.conftest import DRYRUN

SEQ = 256 if DRYRUN else 65536
CASES = {
    "memo-auto": ["memory.mst=true", "memory.activation_offload=memo", "memory.offload_fraction=auto"],
    "fpdt-u8-offload": ["memory.mst=true", "parallel.cp_comm_type=fpdt", f"memory.fpdt_chunk_size={SEQ // 8}",
                        "memory.fpdt_offload=true"],
}
MIN_OVERLAP = 0.90
POINT_LIMIT_S = 240


def test_overlap_fraction_on_synthetic_intervals():
    f = _util.overlap_fraction
    assert f([], [(0, 10)]) == 1.0
    assert f([(0, 10)], []) == 0.0
    assert f([(0, 10)], [(0, 4), (2, 6), (8, 20)]) == pytest.approx(0.8)  # overlapping kernels counted once
    assert f([(0, 10), (5, 15)], [(0, 15)]) == 1.0  # copies on two streams at once: their union
    assert f([(0, 10), (20, 30)], [(5, 25)]) == pytest.approx(0.5)
    trace = {"traceEvents": [
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 10,
         "args": {"bytes": 1024}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 0, "dur": 50},
        {"ph": "X", "cat": "kernel", "name": "ampere_bf16_gemm", "ts": 2, "dur": 6},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}, {"ph": "i", "name": "marker"}]}
    got = _util.trace_intervals(trace)
    assert got["copies"] == [(0.0, 10.0)] and got["compute"] == [(2.0, 8.0)] and got["copy_bytes"] == 1024
    assert f(got["copies"], got["compute"]) == pytest.approx(0.6)


@pytest.mark.parametrize("name", list(CASES))
def test_copies_overlap_compute(device, record, tmp_path, name):
    path = str(tmp_path / f"{name}.json")
    spec = {"kind": "framework", "device": device.type, "seq": SEQ, "steps": 2, "bf16": True, "model": _util.MODEL,
            "sets": CASES[name], "profile_trace": path}
    t0 = time.time()
    res = _util.run_worker(spec, min(POINT_LIMIT_S, _util.deadline() - time.time()))
    assert res["ok"], res
    with open(path) as f:
        got = _util.trace_intervals(json.load(f))
    frac = _util.overlap_fraction(got["copies"], got["compute"])
    copy_s = sum(e - s for s, e in _util.merged(got["copies"])) / 1e6
    record("T4 copy/compute overlap (a profiled step at %d tokens)" % SEQ, name,
           {"overlap": round(frac, 4), "copies": len(got["copies"]), "copy_s": round(copy_s, 4),
            "copy_GB": round(got["copy_bytes"] / 1e9, 3), "kernels": len(got["compute"]),
            "step_s": [round(x, 3) for x in res["step_s"]], "memo_alpha": res.get("memo_alpha"),
            "trace_MB": round(os.path.getsize(path) / 2**20, 1), "wall_s": round(time.time() - t0, 1)})
    if device.type == "cuda":
        assert got["copies"], "no host<->device copy in the profiled step: the offload did not run"
        assert frac >= MIN_OVERLAP, frac
