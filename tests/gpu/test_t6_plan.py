"""T6: ``memory.plan: auto`` vs ``off`` on the 1B Llama at 32K tokens with FPDT (P = 1, u = 4, offload) and MsT,
bf16, 3 steps, each in a fresh process: peak reserved and allocated device bytes (``torch.cuda.max_memory_*``), the
arena's requests / planned / fallbacks, the plan's peak vs its lower bound and the caching allocator the planner
simulated. Asserted: under the plan every framework buffer request is served from it (no fallback), the plan's
peak is at least its lower bound, and the first step's loss is the unplanned one (the plan changes where buffers
live, not what is computed). Reserved bytes are recorded, not asserted. Dry run: the tiny model, 128 tokens, 1 step."""
import time

from tests.gpu import _util
from tests.gpu.conftest import DRYRUN

SEQ = 128 if DRYRUN else 32768
SETS = ["memory.mst=true", "parallel.cp_comm_type=fpdt", f"memory.fpdt_chunk_size={SEQ // 4}",
        "memory.fpdt_offload=true", "memory.plan_time_limit=" + ("2" if DRYRUN else "20")]
POINT_LIMIT_S = 240


def test_plan_auto_vs_off(device, record):
    res = {}
    for plan in ("off", "auto"):
        spec = {"kind": "framework", "device": device.type, "seq": SEQ, "steps": 1 if DRYRUN else 3, "bf16": True,
                "model": _util.MODEL, "sets": SETS + [f"memory.plan={plan}"]}
        res[plan] = _util.run_worker(spec, min(POINT_LIMIT_S, _util.deadline() - time.time()))
        assert res[plan]["ok"], res[plan]
    off, auto = res["off"], res["auto"]
    figures = {plan: {k: r.get(k) for k in ("max_reserved_bytes", "max_allocated_bytes", "arena", "plan",
                                             "plan_sim_reserved_bytes", "step_s", "wall_s")}
               for plan, r in res.items()}
    if device.type == "cuda":
        figures["reserved_auto_over_off"] = round(auto["max_reserved_bytes"] / off["max_reserved_bytes"], 4)
    record(f"T6 memory.plan auto vs off (FPDT u=4 offload + MsT, {SEQ} tokens)", "figures", figures)
    arena = auto["arena"]
    assert arena["requests"] > 0 and arena["fallbacks"] == 0 and arena["planned"] == arena["requests"], arena
    assert auto["plan"]["peak_bytes"] >= auto["plan"]["lower_bound_bytes"] > 0, auto["plan"]
    assert abs(auto["loss"][0] - off["loss"][0]) <= 1e-5 * abs(off["loss"][0]), (auto["loss"], off["loss"])
