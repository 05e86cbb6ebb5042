"""The estimator's fit / OOM predictions for the runs the papers publish; prints JSON (docs/estimator.md).

    python bench/estimate_papers.py                  # all three tables
    python bench/estimate_papers.py memo             # memo | fpdt | mst

* Memo Tables 3 + 7 (A800-80GB, 2 TB host per 8-GPU node): every Memo cell with its published layout (tp, cp, dp,
  alpha; sequence parallel and ZeRO-1 on) estimated as Memo offload with a memory plan; the first oom/oohm cell of
  each row with the layout of the longest cell that ran. Model states as this framework holds them and as
  Megatron (Memo's base) does (``--states megatron``).
* FPDT Table 1 (A100 40 GB / 80 GB, 4-GPU nodes with 1 TB host): the longest sequence (of the table's grid) that
  fits with FPDT (Ulysses over all GPUs, 64K chunks, offload) + MsT + activation offload (alpha = 0), with ZeRO-3
  model states as in the paper (a what-if: the framework has no ZeRO-3) and with the framework's own.
* MsT Table 2 (one A100-80GB): the longest sequence (1K steps) for vanilla / recompute / MsT + recompute with pure
  bf16 and the optimizer step in the backward (MsT's setup, a what-if) and with the framework's states.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config import ConfigError  # noqa: E402
from megatron_lc.estimate import estimate, load_hardware  # noqa: E402
from megatron_lc.estimate.hardware import GIB  # noqa: E402
from paper_models import K, config  # noqa: E402  (bench/, the script's own folder)
from paper_time_cells import MEMO_T7, SEQS  # noqa: E402
import paper_times  # noqa: E402


def run(cfg, hw, world, states="framework", style="token_wise"):
    try:
        e = estimate(cfg, hw, world, states=states, recompute_style=style)
    except ConfigError as err:
        return {"status": "invalid", "why": str(err)}
    return {"status": e.status, "peak_gib": round(e.memory.peak / GIB, 1), "phase": e.memory.peak_phase,
            "host_gib_per_node": round(e.memory.host_per_node / GIB), "mfu": round(e.time.mfu, 3)}


# ---- Memo Tables 3 and 7 ---------------------------------------------------------------------------------------
def memo_cell(model, seq, tp, cp, dp, alpha):
    return config(model, seq * K, parallel__tensor_model_parallel_size=tp, parallel__context_parallel_size=cp,
                  parallel__cp_comm_type="p2p", parallel__sequence_parallel=tp > 1,
                  parallel__use_distributed_optimizer=True, train__global_batch_size=dp,
                  memory__activation_offload="memo", memory__offload_fraction=alpha, memory__plan="auto")


def memo_tables() -> list:
    hw = load_hardware("a800")
    rows = []
    for (gpus, model), cells in MEMO_T7.items():
        last = None
        for seq, cell in zip(SEQS, cells):
            if isinstance(cell, str):
                if last is None:
                    continue
                tp, cp, dp, pp, alpha = last
                row = {"table": "memo", "gpus": gpus, "model": model, "seq_k": seq, "paper": cell,
                       "layout": f"tp{tp} cp{cp} dp{dp} a={alpha} (layout of the longest run)"}
                cfg = memo_cell(model, seq, tp, cp, dp, alpha)
                row["framework"] = run(cfg, hw, gpus)
                row["megatron_states"] = run(cfg, hw, gpus, "megatron")
                rows.append(row)
                last = None  # only the first failing length of a row
                continue
            tp, cp, dp, pp, alpha = cell
            row = {"table": "memo", "gpus": gpus, "model": model, "seq_k": seq, "paper": "fits",
                   "layout": f"tp{tp} cp{cp} dp{dp} pp{pp} a={alpha}"}
            if pp > 1:
                row["framework"] = row["megatron_states"] = {"status": "skipped", "why": "pipeline parallel"}
            else:
                cfg = memo_cell(model, seq, tp, cp, dp, alpha)
                row["framework"] = run(cfg, hw, gpus)
                row["megatron_states"] = run(cfg, hw, gpus, "megatron")
                last = cell
            rows.append(row)
    return rows


# ---- FPDT Table 1 ----------------------------------------------------------------------------------------------
FPDT_GRID = [128, 256, 512, 1024, 2048, 3072, 4096, 8192]
FPDT = {  # model -> {(hardware, gpus): published max (K tokens; "-" = the model does not fit; 8192 means "8M+")}
    "gpt-2.7b": {("a100_40gb", 1): 128, ("a100_40gb", 2): 512, ("a100_40gb", 4): 2048, ("a100_40gb", 8): 4096,
                 ("a100", 4): 4096, ("a100", 8): 8192, ("a100", 16): 8192, ("a100", 32): 8192},
    "llama3-8b": {("a100_40gb", 8): 1024, ("a100", 4): 2048, ("a100", 8): 4096, ("a100", 16): 8192,
                  ("a100", 32): 8192},
    "gpt-13b": {("a100_40gb", 8): 256, ("a100", 4): 512, ("a100", 8): 3072, ("a100", 16): 4096, ("a100", 32): 8192},
    "gpt-30b": {("a100", 8): 1024, ("a100", 16): 3072, ("a100", 32): 4096},
    "llama3-70b": {("a100", 16): 1024, ("a100", 32): 4096},
}


def fpdt_cfg(model, seq_k, gpus, ours=False):
    """FPDT over all GPUs, 64K chunks, offload, MsT-style FFN/loss chunking; the paper adds activation checkpointing
    with CPU offload (here: Memo α = 0 under recompute_style=checkpoint). The framework cannot combine FPDT with
    recompute/Memo yet, so ``ours`` is FPDT + MsT alone."""
    extra = {} if ours else {"memory__activation_offload": "memo", "memory__offload_fraction": 0.0}
    return config(model, seq_k * K, parallel__context_parallel_size=gpus, parallel__cp_comm_type="fpdt",
                  memory__fpdt_chunk_size=min(64 * K, seq_k * K), memory__fpdt_offload=True, memory__mst=True,
                  parallel__use_distributed_optimizer=True, **extra)


def longest(make, hw, gpus, grid, states, style="token_wise") -> dict:
    best, why = None, None
    for seq in grid:
        r = run(make(seq), hw, gpus, states, style)
        if r["status"] == "fits":
            best = seq
        else:
            why = r.get("why") or f"{r['status']} at {seq}K ({r.get('phase')}, {r.get('peak_gib')} GiB)"
            if r["status"] != "invalid":
                break
    return {"max_k": best, "stops": why}


def fpdt_table() -> list:
    rows = []
    for model, cells in FPDT.items():
        for (hw_name, gpus), paper in cells.items():
            hw = load_hardware(hw_name, {"gpus_per_node": 4, "host_memory_gib": 1024})
            row = {"table": "fpdt", "model": model, "hardware": hw.name, "gpus": gpus, "paper_max_k": paper}
            # the paper's setup (what-ifs: ZeRO-3, classic checkpointing with the inputs offloaded), then ours
            row["paper_setup"] = longest(lambda s: fpdt_cfg(model, s, gpus), hw, gpus, FPDT_GRID, "zero3",
                                         "checkpoint")
            row["framework"] = longest(lambda s: fpdt_cfg(model, s, gpus, ours=True), hw, gpus, FPDT_GRID,
                                       "framework")
            rows.append(row)
    return rows


# ---- MsT Table 2 -----------------------------------------------------------------------------------------------
MST = {"llama3-8b": {"vanilla": 5, "recompute": 14, "mst": 60}, "llama2-7b": {"vanilla": 7, "recompute": 45, "mst": 84}}


def mst_table() -> list:
    hw = load_hardware("a100")
    grid = list(range(1, 129))
    variants = {"vanilla": {}, "recompute": {"memory__recompute_granularity": "full"},
                "mst": {"memory__recompute_granularity": "full", "memory__mst": True}}
    rows = []
    for model, paper in MST.items():
        for name, extra in variants.items():
            row = {"table": "mst", "model": model, "variant": name, "paper_max_k": paper[name]}
            # the paper's setup (what-ifs: pure bf16 + optimizer in backward, classic checkpointing), then ours
            row["paper_setup"] = longest(lambda s: config(model, s * K, **extra), hw, 1, grid,
                                         "bf16_optim_in_backward", "checkpoint")
            row["framework"] = longest(lambda s: config(model, s * K, **extra), hw, 1, grid, "framework")
            rows.append(row)
    return rows


def main(argv: list) -> dict:
    if "--time" in argv:
        out = paper_times.run_all()
        if "--fit" in argv:
            out["fit"] = paper_times.fit()
        if "--terms" in argv:
            out["terms"] = paper_times.terms_moved()
        return out
    which = [a for a in argv if not a.startswith("--")] or ["memo", "fpdt", "mst"]
    out = {}
    if "memo" in which:
        out["memo"] = memo_tables()
    if "fpdt" in which:
        out["fpdt"] = fpdt_table()
    if "mst" in which:
        out["mst"] = mst_table()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
