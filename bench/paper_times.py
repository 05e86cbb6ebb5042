"""The estimator's step time against every published one (``bench/paper_time_cells.py``): each cell with its
published layout, predicted vs published side by side, the ratio, a summary per set; the calibration (``fit``).

    python bench/estimate_papers.py --time           # JSON: every cell, the summaries
    python bench/estimate_papers.py --time --fit     # + what the calibration set gives (configs/hardware/*.yaml)

ratio = predicted / published throughput (> 1: the model is too fast): Memo's, FPDT's MFU ratio, ALST's and MsT's
published seconds over predicted (paper_time_cells.py says why). How each paper's system is given to the estimator:

* Memo (A800): Megatron-LM's model states and gradient sync (``states="megatron"``), ring context parallelism,
  SP, ZeRO-1, a memory plan; its rows Memo offload with Table 7's alpha; Table 4's full recompute re-runs whole
  layers (``recompute_style="checkpoint"``), its full swapping is alpha 1. Megatron-LM's rows: the same states,
  Table 6's layouts, full recompute of whole layers, no plan. DeepSpeed's: ZeRO-3 (``states="zero3"``), Ulysses over
  Table 5's SP, whole-layer recompute.
* ALST (H100, flash_attn 2: ``attention_backend: flash``): this framework's own features for its setup -- FSDP2 with
  CPU offload (ZeRO-3 with the optimizer on the CPU; the 1-GPU runs offload the weights too), a bf16 residual
  stream (Hugging Face's), Ulysses over all GPUs (its baselines: data parallel, one sample a GPU), the tiled MLP as
  MsT, activation checkpoints on the host or, without that offload, whole-layer recompute.
* FPDT (A100, 4 a node): FPDT over 8 GPUs with 64K chunks and offload, MsT, ZeRO-3, checkpoints with the layer
  inputs on the host (Memo alpha 0 under ``recompute_style="checkpoint"``).
* MsT (one A100): Hugging Face's pure bf16 with the optimizer in the backward (``states="bf16_optim_in_backward"``),
  PyTorch's SDPA (``torch``), gradient checkpointing as whole-layer recompute; as its published scripts ran a step:
  C4's documents, its data streamed each step (``paper_time_cells.MST_C4_MEAN_TOKENS``, ``MST_HARNESS_SECONDS``).
"""
from __future__ import annotations

import contextlib
import math
import statistics
from unittest import mock

from megatron_lc.config import ConfigError
from megatron_lc.estimate import estimate, load_hardware, sync_time
from megatron_lc.estimate.terms.mst import MLP_RERUN_COST
from megatron_lc.units import GIB
from paper_models import K, config
from paper_time_cells import (ALST, DEEPSPEED_T3, DEEPSPEED_T5, FPDT, MEGATRON_T3, MEGATRON_T6, MEMO_T3, MEMO_T4,
                              MEMO_T7, MST, MST_C4_MEAN_TOKENS, MST_PAIRS, SEQS)

MEMO_HW = "a800"


def _memo_like(model, seq_k, tp, cp, dp, **extra):
    return config(model, seq_k * K, parallel__tensor_model_parallel_size=tp, parallel__context_parallel_size=cp,
                  parallel__cp_comm_type="p2p", parallel__sequence_parallel=tp > 1,
                  parallel__use_distributed_optimizer=True, train__global_batch_size=dp, **extra)


def memo_cells() -> list:
    """Memo's Table 3 rows (Table 7's layouts), Table 4, and Table 3's Megatron-LM and DeepSpeed rows."""
    cells = []
    for (gpus, model), row in MEMO_T3.items():
        for seq, pub, lay in zip(SEQS, row, MEMO_T7[(gpus, model)]):
            if pub is None:
                continue
            tp, cp, dp, pp, alpha = lay
            cell = {"id": f"memo-t3-{model}-{seq}k", "paper": "Memo", "table": "Table 3", "set": "validation",
                    "family": "memo", "gpus": gpus, "layout": f"tp{tp} cp{cp} dp{dp} a={alpha}",
                    "published": {"mfu": pub[0] / 100, "tgs": pub[1]}}
            if pp > 1:
                cells.append({**cell, "skipped": "pipeline parallel (the framework has none)"})
                continue
            cells.append({**cell, "run": (_memo_like(model, seq, tp, cp, dp, memory__activation_offload="memo",
                                                     memory__offload_fraction=alpha, memory__plan="auto"),
                                          MEMO_HW, gpus, "megatron", "token_wise")})
    rows = {"full recompute": ("baseline", {"memory__recompute_granularity": "full"}),
            "full recompute + plan": ("calibration", {"memory__recompute_granularity": "full",
                                                      "memory__plan": "auto"}),
            "full swapping + plan": ("calibration", {"memory__activation_offload": "memo",
                                                     "memory__offload_fraction": 1.0, "memory__plan": "auto"}),
            "memo": ("validation", {"memory__activation_offload": "memo", "memory__offload_fraction": 0.0,
                                    "memory__plan": "auto"})}
    for name, (kind, extra) in rows.items():
        for seq, mfu in zip(SEQS, MEMO_T4[name]):
            if mfu is None or (name == "memo" and seq != 64):  # the Memo row's 128K-896K are Table 3's cells
                continue
            style = "token_wise" if "memory__activation_offload" in extra else "checkpoint"
            cells.append({"id": f"memo-t4-{name.replace(' + ', '-').replace(' ', '-')}-{seq}k", "paper": "Memo",
                          "table": "Table 4", "set": kind, "family": "memo-t4-" + name, "gpus": 8,
                          "layout": f"tp4 cp2 dp1 {name}", "published": {"mfu": mfu / 100},
                          "run": (_memo_like("gpt-7b", seq, 4, 2, 1, **extra), MEMO_HW, 8, "megatron", style)})
    for (gpus, model), row in MEGATRON_T3.items():
        lays = MEGATRON_T6[(gpus, model)]
        for i, (seq, pub) in enumerate(zip(SEQS, row)):
            cell = {"id": f"megatron-{model}-{seq}k", "paper": "Memo", "table": "Table 3", "set": "baseline",
                    "family": "megatron", "gpus": gpus, "published": {"mfu": pub[0] / 100, "tgs": pub[1]}}
            if i >= len(lays):
                cells.append({**cell, "skipped": "Table 6 publishes no layout for this cell"})
                continue
            tp, cp, dp, pp = lays[i]
            cell["layout"] = f"tp{tp} cp{cp} dp{dp} pp{pp} recompute"
            if pp > 1:
                cells.append({**cell, "skipped": "pipeline parallel (the framework has none)"})
                continue
            cells.append({**cell, "run": (_memo_like(model, seq, tp, cp, dp, memory__recompute_granularity="full"),
                                          MEMO_HW, gpus, "megatron", "checkpoint")})
    for (gpus, model), row in DEEPSPEED_T3.items():
        for seq, pub, (sp, dp) in zip(SEQS, row, DEEPSPEED_T5[(gpus, model)]):
            cells.append({"id": f"deepspeed-{model}-{seq}k", "paper": "Memo", "table": "Table 3", "set": "baseline",
                          "family": "deepspeed", "gpus": gpus, "layout": f"ulysses{sp} dp{dp} zero3 recompute",
                          "published": {"mfu": pub[0] / 100, "tgs": pub[1]},
                          "run": (config(model, seq * K, parallel__context_parallel_size=sp,
                                         parallel__cp_comm_type="a2a", train__global_batch_size=dp,
                                         memory__recompute_granularity="full"), MEMO_HW, gpus, "zero3",
                                  "checkpoint")})
    return cells


def alst_cells() -> list:
    cells = []
    for cid, table, gpus, tokens, secs, ulysses, _logits, tiled_mlp, offload, kind in ALST:
        extra = {"parallel__use_torch_fsdp2": True, "parallel__fsdp_cpu_offload": True,
                 "parallel__attention_backend": "flash", "model__fp32_residual_connection": False,
                 "memory__mst": tiled_mlp}
        if ulysses:
            extra.update(parallel__context_parallel_size=gpus, parallel__cp_comm_type="a2a")
        else:
            extra.update(train__global_batch_size=gpus)
        if offload:
            extra["memory__activation_offload"] = "checkpoints"
        else:
            extra["memory__recompute_granularity"] = "full"
        layout = (f"ulysses{gpus}" if ulysses else f"dp{gpus}") + (" ckpt-offload" if offload else " recompute") + \
            (" mst" if tiled_mlp else "") + " fsdp2-cpu-offload flash"
        cells.append({"id": cid, "paper": "ALST", "table": table, "set": kind,
                      "family": "alst" if kind != "baseline" else "alst-baseline", "gpus": gpus, "layout": layout,
                      "published": {"seconds": secs, "tokens": tokens},
                      "run": (config("llama3-8b", tokens, **extra), "h100", gpus, "framework",
                              "token_wise" if offload else "checkpoint")})
    return cells


def fpdt_cells() -> list:
    return [{"id": cid, "paper": "FPDT", "table": "Table 3", "set": kind, "family": "fpdt", "gpus": gpus,
             "layout": "fpdt8 chunk64K offload mst zero3 ckpt-offload (checkpoint)",
             "published": {"mfu": mfu / 100, "note": "MFU definition not stated"},
             "run": (config("llama3-8b", tokens, parallel__context_parallel_size=gpus, parallel__cp_comm_type="fpdt",
                            memory__fpdt_chunk_size=64 * K, memory__fpdt_offload=True, memory__mst=True,
                            memory__activation_offload="memo", memory__offload_fraction=0.0),
                     ("a100", {"gpus_per_node": 4, "host_memory_gib": 1024}), gpus, "zero3", "checkpoint")}
            for cid, gpus, tokens, mfu, kind in FPDT]


MST_VARIANTS = {"vanilla": ({}, "token_wise"), "recompute": ({"memory__recompute_granularity": "full"}, "checkpoint"),
                "mst": ({"memory__recompute_granularity": "full", "memory__mst": True}, "checkpoint"),
                "mst_no_recompute": ({"memory__mst": True}, "token_wise")}


# The host work a step of MsT's harness (its C4 stream opened again each step, the tokenizer, the per-parameter
# optimizer hooks' Python): what the four calibration cells leave after the model's step, their mean
# (``fit()["mst_harness"]``; bench/estimate_papers.py --time --fit)
MST_HARNESS_SECONDS = 0.76


def mst_cells() -> list:
    """MsT's Table 6 as its harness ran it (paper_time_cells.MST_C4_MEAN_TOKENS): C4's documents, the harness's host
    work a step as the A100's ``step_overhead_seconds``."""
    cells = []
    docs = {"data__reset_attention_mask": True, "data__mean_document_length": MST_C4_MEAN_TOKENS} \
        if MST_C4_MEAN_TOKENS else {}
    for cid, model, tokens, batch, variant, secs, kind in MST:
        extra, style = MST_VARIANTS[variant]
        cells.append({"id": cid, "paper": "MsT", "table": "Table 6", "set": kind, "family": "mst", "gpus": 1,
                      "layout": f"{variant} batch {batch}", "published": {"seconds": secs},
                      "run": (config(model, tokens, train__micro_batch_size=batch, train__global_batch_size=batch,
                                     parallel__attention_backend="torch", **docs, **extra),
                              ("a100", {"step_overhead_seconds": MST_HARNESS_SECONDS}), 1,
                              "bf16_optim_in_backward", style)})
    return cells


def all_cells() -> list:
    return memo_cells() + alst_cells() + fpdt_cells() + mst_cells()


def hardware(spec, overrides=None):
    name, extra = (spec, {}) if isinstance(spec, str) else spec
    return load_hardware(name, {**extra, **(overrides or {})})


def predict(cell: dict, overrides: dict | None = None) -> dict:
    """The cell's estimate beside its published figure; ``overrides``: {hardware name: profile overrides}."""
    cfg, hw_spec, gpus, states, style = cell["run"]
    name = hw_spec if isinstance(hw_spec, str) else hw_spec[0]
    try:
        est = estimate(cfg, hardware(hw_spec, (overrides or {}).get(name)), gpus, states=states,
                       recompute_style=style)
    except ConfigError as err:
        return {"status": "invalid", "why": str(err)}
    t, pub = est.time, cell["published"]
    ratio = pub["seconds"] / t.step_seconds if "seconds" in pub else t.mfu / pub["mfu"]
    return {"status": est.status, "peak_gib": round(est.memory.peak / GIB, 1), "step_s": round(t.step_seconds, 3),
            "mfu": round(t.mfu, 4), "tgs": round(t.tokens_per_gpu_per_s, 2), "ratio": round(ratio, 4),
            "attention": f"{t.attention_backend} {t.efficiencies['attention forward'][0]:.3f} / "
                         f"{t.efficiencies['attention backward'][0]:.3f}",
            "parts": {k: round(v, 3) for k, v in t.parts.items() if v}}


def summary(rows: list) -> dict:
    """Per set and family: cells, median ratio and |ratio - 1|, range."""
    out: dict = {}
    for r in rows:
        if "ratio" not in r.get("predicted", {}):
            continue
        out.setdefault(f"{r['set']}: {r['family']}", []).append(r["predicted"]["ratio"])
    return {k: {"cells": len(v), "median_ratio": round(statistics.median(v), 3),
                "median_abs_error": round(statistics.median(abs(x - 1) for x in v), 3),
                "min": round(min(v), 3), "max": round(max(v), 3)} for k, v in sorted(out.items())}


def run_all(overrides: dict | None = None) -> dict:
    rows = []
    for cell in all_cells():
        row = {k: v for k, v in cell.items() if k != "run"}
        if "run" in cell:
            row["predicted"] = predict(cell, overrides)
        rows.append(row)
    return {"cells": rows, "summary": summary(rows)}


# ---- calibration ----------------------------------------------------------------------------------------------
def _ratios(cells: list, overrides: dict) -> list:
    return [predict(c, overrides)["ratio"] for c in cells]


def _loss(ratios: list) -> float:
    return sum(math.log(r) ** 2 for r in ratios)


def _argmin(f, lo: float, hi: float, steps: int = 40) -> float:
    """Golden-section search of a unimodal ``f`` on [lo, hi]."""
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    for _ in range(steps):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if f(c) < f(d) else (c, b)
    return (a + b) / 2


def fit() -> dict:
    """What the calibration set gives (paper_time_cells.py): (1) the A800's FA2-class attention scale (forward /
    backward kept at the profile's former 0.65 / 0.55 proportion) and GEMM efficiency, from Table 4's full recompute
    + plan; (2) the A800's PCIe switch uplink (2 GPUs behind each), from Table 4's full swapping (with (1)); (3) the
    H100 check: ALST's 1.1M and 2.4M with the published FA2 figures; (4) MsT's re-run cost and its harness's host
    work a step, from Table 6's pairs."""
    by_set: dict = {}
    for c in all_cells():
        by_set.setdefault((c["set"], c["family"]), []).append(c)
    recompute = by_set[("calibration", "memo-t4-full recompute + plan")]
    swapping = by_set[("calibration", "memo-t4-full swapping + plan")]

    def a800(gemm: float, k: float, uplink: float | None = None) -> dict:
        o = {"efficiency": {"gemm": gemm}, "attention": {"torch": {"fwd": 0.65 * k, "bwd": 0.55 * k,
                                                                     "source": "fit"}}}
        return {MEMO_HW: o if uplink is None else {**o, "pcie_switch_gbps": uplink}}

    gemm = 0.70
    for _ in range(3):  # coordinate descent: the two barely interact (attention 57-94% of these steps)
        k = _argmin(lambda x: _loss(_ratios(recompute, a800(gemm, x))), 0.8, 1.5)
        gemm = _argmin(lambda x: _loss(_ratios(recompute, a800(x, k))), 0.5, 0.9)
    uplink = _argmin(lambda x: _loss(_ratios(swapping, a800(gemm, k, x))), 10.0, 60.0)
    final = a800(gemm, k, uplink)
    alst = by_set[("calibration", "alst")]
    return {"a800": {"gemm": round(gemm, 3), "attention_fwd": round(0.65 * k, 3),
                     "attention_bwd": round(0.55 * k, 3), "pcie_switch_gbps": round(uplink, 1),
                     "full recompute + plan ratios": _ratios(recompute, final),
                     "full swapping + plan ratios": _ratios(swapping, final)},
            "h100_alst_check_ratios": _ratios(alst, {}),
            **mst_calibration()}


def mst_calibration() -> dict:
    """From Table 6's same-batch pairs: MsT's re-run cost -- the published MsT - recompute step difference over the
    seconds one MLP forward re-run adds to the model's step (the MsT step's re-run counted at ``MLP_RERUN_COST``);
    then the host work a step of MsT's harness -- the mean of what the four cells leave after the model's step
    without it (seconds). A fixed cost cancels from each difference: the two do not interact."""
    cells = {c["id"]: c for c in all_cells()}
    bare = {"a100": {"step_overhead_seconds": 0.0}}
    out, left = [], []
    for rec_id, mst_id in MST_PAIRS:
        rec, mst = predict(cells[rec_id], bare), predict(cells[mst_id], bare)
        pub_rec, pub_mst = cells[rec_id]["published"]["seconds"], cells[mst_id]["published"]["seconds"]
        added = (mst["step_s"] - rec["step_s"]) / MLP_RERUN_COST  # one MLP forward again, per step
        out.append({"pair": [rec_id, mst_id], "published_difference_s": round(pub_mst - pub_rec, 3),
                    "cost": round((pub_mst - pub_rec) / added, 3)})
        left += [pub_rec - rec["step_s"], pub_mst - mst["step_s"]]
    return {"mst_rerun": {"pairs": out, "mean_cost": round(statistics.mean(p["cost"] for p in out), 3)},
            "mst_harness": {"left_after_the_model_s": [round(x, 3) for x in left],
                            "mean_s": round(statistics.mean(left), 3)}}


# ---- what each term moves ---------------------------------------------------------------------------------------
def _flat_collective(self, ranks, stride):  # the former rule: a group spanning nodes at one NIC's bandwidth
    return self.link_bytes_per_s(ranks, stride)


def _flat_all_to_all(self, sent, ranks, stride):  # the former rule: every share at the slowest link's bandwidth
    return sent / self.link_bytes_per_s(ranks, stride) if ranks > 1 else 0.0


def _serial_sync(cfg, states):  # the former rule: FSDP2 its own, every other system after the backward
    return "per_layer" if states == "framework" and cfg.parallel.use_torch_fsdp2 else "after_backward"


def _whole_micro_fsdp(cfg, dims, hw, ranks, fwd, bwd, states):  # the former rule: a micro-batch's traffic at once
    layer, total = sync_time.layer_numels(dims)
    vol = (ranks - 1) / ranks * total * (2 * dims.compute_bytes + 4) if ranks > 1 else 0.0
    secs = vol / hw.collective_bytes_per_s(ranks, dims.tp) if ranks > 1 else 0.0
    if cfg.parallel.fsdp_cpu_offload:
        secs += 3 * 4 * total / ranks / (hw.pcie_gbps * 1e9)
    return max(0.0, secs - dims.num_layers * (fwd + bwd))


FORMER = {  # term -> (patches, hardware overrides) that restore the rule it replaced
    "collectives across nodes: pooled NICs, all-to-all's away share": (
        [("megatron_lc.estimate.hardware.HardwareProfile.collective_bytes_per_s", _flat_collective),
         ("megatron_lc.estimate.hardware.HardwareProfile.all_to_all_seconds", _flat_all_to_all)], {}),
    "gradient sync overlapped as each system issues it": (
        [("megatron_lc.estimate.sync_time.sync_style", _serial_sync)], {}),
    "FSDP2 / ZeRO-3 prefetch exposure per layer": (
        [("megatron_lc.estimate.sync_time.per_layer_exposed", _whole_micro_fsdp)], {}),
    "host copies share a PCIe switch's uplink": (
        [], {name: {"pcie_switch_gbps": None} for name in ("a800", "a100")}),
    "MsT's re-run at its measured cost": ([("megatron_lc.estimate.terms.mst.MLP_RERUN_COST", 1.0)], {}),
    "MsT's harness as its scripts ran it (C4's documents, its host work a step)": (
        [(f"{__name__}.MST_C4_MEAN_TOKENS", 0)], {"a100": {"step_overhead_seconds": 0.0}}),
    "the kernel that runs (published / calibrated efficiencies)": (
        [], {"h100": {"efficiency": {"attention_fwd": 0.60, "attention_bwd": 0.50}},
             "a800": {"efficiency": {"gemm": 0.70, "attention_fwd": 0.65, "attention_bwd": 0.55}},
             "a100": {"efficiency": {"gemm": 0.70, "attention_fwd": 0.65, "attention_bwd": 0.55}}}),
}


def terms_moved(threshold: float = 0.01) -> dict:
    """For each term: every cell whose ratio moves by more than ``threshold`` when the term's former rule is put
    back (the former efficiencies: the profiles' assumed 0.60 / 0.50 on H100, 0.70 gemm and 0.65 / 0.55 on A800 /
    A100), with both ratios."""
    now = {c["id"]: predict(c)["ratio"] for c in all_cells() if "run" in c}
    out = {}
    for term, (patches, overrides) in FORMER.items():
        with contextlib.ExitStack() as stack:
            for target, value in patches:
                stack.enter_context(mock.patch(target, value))
            former = {c["id"]: predict(c, overrides)["ratio"] for c in all_cells() if "run" in c}
        moved = {cid: {"former": former[cid], "now": now[cid]} for cid in now
                 if abs(now[cid] / former[cid] - 1) > threshold}
        out[term] = {"cells_moved": len(moved), "cells": moved}
    return out
