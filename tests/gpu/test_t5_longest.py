"""T5: the longest trainable sequence, tokens/s and MFU of the 1B Llama (Llama-3.2-1B's shape, bf16 autocast, fp32
master weights, batch 1, 3 steps, each point a fresh process: ``bench/gpu_worker.py``) for the framework's variants
and for Hugging Face ``LlamaForCausalLM`` with gradient checkpointing and SDPA on the same GPU. Per variant: lengths
double from 8K (the memory techniques from 64K) until one fails, then bisection to 4K, within T5's time budget
(what is left of the 25 minutes, at most ``BUDGET_S``); where the budget stopped a search is recorded. Targets on a
GPU: the framework's longest >= 8x Hugging Face's, MFU >= 40% at 64K (the best variant; ``_util.MFU_FORMULA``), and
our points fail only by running out of memory or time. Dry run: the tiny model, lengths 64 -> 256, an
out-of-memory simulated above a length, to run the search and the process plumbing."""
import time

import pytest
import torch

from tests.gpu import _util
from tests.gpu.conftest import DRYRUN

VARIANTS = {  # name -> --set items (None: Hugging Face); cheap ones first, the rest of the budget to the last
    "plain": [],
    "hf-gc": None,
    "fpdt-p1-offload": ["parallel.cp_comm_type=fpdt", "memory.fpdt_offload=true"],
    "mst-full-recompute": ["memory.mst=true", "memory.recompute_granularity=full"],
    "mst-memo-auto": ["memory.mst=true", "memory.activation_offload=memo", "memory.offload_fraction=auto"],
    # issue 17's rows: the token-wise parts in mini-sequences; FSDP2 with its states on the host (the one-GPU case)
    "mst-full-chunks": ["memory.mst=true", "memory.recompute_granularity=full", "memory.layer_chunk_size=8192"],
    "mst-memo-auto-fsdp2-offload": ["memory.mst=true", "memory.activation_offload=memo",
                                    "memory.offload_fraction=auto", "parallel.use_torch_fsdp2=true",
                                    "parallel.fsdp_cpu_offload=true"],
    "mst-ckpt-chunks-fsdp2-offload": ["memory.mst=true", "memory.activation_offload=checkpoints",
                                      "memory.layer_chunk_size=8192", "model.fp32_residual_connection=false",
                                      "parallel.use_torch_fsdp2=true", "parallel.fsdp_cpu_offload=true"],
}
DRY_VARIANTS = {"hf-gc": 96, "mst-memo-auto": 160}  # dry run: name -> simulated out-of-memory above this length
START, GRANULARITY, CAP = (64, 64, 256) if DRYRUN else (8192, 4096, 1 << 20)
# the memory techniques start at 64K (the MFU point; a failure there bisects down): 8K-32K would only spend budget
START_AT = {} if DRYRUN else {n: 65536 for n in VARIANTS if n not in ("plain", "hf-gc")}
BUDGET_S = 600 if DRYRUN else 840  # dry run: an upper bound only (a busy 2-core machine), it ends sooner
MFU_AT = 128 if DRYRUN else 65536
STEPS = 2 if DRYRUN else 3
SECTION = "T5 longest sequence (1B Llama, bf16, batch 1, 3 steps)"
TARGET_RATIO, TARGET_MFU = 8, 0.40


def fpdt_chunk(seq: int) -> int:
    """FPDT's chunk: the largest power of two <= 16K dividing ``seq`` (every length searched is a multiple of 4K)."""
    c = 16384
    while seq % c:
        c //= 2
    return c


def point(name: str, device: torch.device, peak):
    def run(seq: int, time_left: float) -> dict:
        sets = VARIANTS[name]
        spec = {"kind": "hf" if sets is None else "framework", "device": device.type, "seq": seq, "steps": STEPS,
                "bf16": True, "model": _util.MODEL, "sets": list(sets or [])}
        if name.startswith("fpdt"):
            spec["sets"].append(f"memory.fpdt_chunk_size={fpdt_chunk(seq)}")
        if DRYRUN:
            spec["simulate_oom_above"] = DRY_VARIANTS.get(name, CAP)
        res = _util.run_worker(spec, time_left)
        if res["ok"]:
            res["tokens_per_s"] = round(_util.tokens_per_s(res, seq), 1)
            res["mfu"] = round(_util.mfu(seq, res["tokens_per_s"], peak), 4) if peak else None
        return res
    return run


def summary(found: dict) -> dict:
    pts = {seq: {k: r.get(k) for k in ("ok", "oom", "error", "tokens_per_s", "mfu", "max_allocated_bytes",
                                       "max_reserved_bytes", "memo_alpha", "wall_s") if r.get(k) is not None}
           for seq, r in found["points"].items()}
    return {"longest": found["longest"], "first_failing": found["first_failing"], "stopped": found["stopped"],
            "points": pts}


def test_longest_sequence_and_mfu(device, record):
    name_dev = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    peak = _util.peak_tflops(name_dev) or (0.1 if DRYRUN else None)
    variants = list(DRY_VARIANTS) if DRYRUN else list(VARIANTS)
    end = min(time.time() + BUDGET_S, _util.deadline() - 30)
    record(SECTION, "setup",
           {"model": _util.MODEL, "start": START, "granularity": GRANULARITY, "cap": CAP,
            "budget_s": round(end - time.time()), "peak_tflops": peak, "mfu_formula": _util.MFU_FORMULA})
    results = {}
    for i, name in enumerate(variants):
        share = (end - time.time()) / (len(variants) - i)  # what an earlier variant left goes to the later ones
        found = _util.longest(point(name, device, peak), START_AT.get(name, START), GRANULARITY, CAP, share)
        results[name] = found
        record(SECTION, name, summary(found))
    ours = {n: f for n, f in results.items() if VARIANTS[n] is not None}
    errors = {n: r["error"] for n, f in ours.items() for r in f["points"].values()
              if not r["ok"] and not r.get("oom") and not r.get("timeout")}
    assert not errors, errors  # our points may run out of memory or time, never fail otherwise (HF's: recorded)
    best = max(f["longest"] for f in ours.values())
    hf = results["hf-gc"]["longest"]
    at = {n: f["points"][MFU_AT].get("mfu") for n, f in ours.items() if f["points"].get(MFU_AT, {}).get("ok")}
    record(SECTION, "targets",
           {"ours_longest": best, "hf_longest": hf, "ratio": round(best / hf, 2) if hf else None,
            f"mfu_at_{MFU_AT}": at})
    if device.type == "cuda":
        assert hf and best >= TARGET_RATIO * hf, (best, hf, {n: f["stopped"] for n, f in results.items()})
        assert at and max(v or 0 for v in at.values()) >= TARGET_MFU, at
    else:
        assert results["mst-memo-auto"]["longest"] == 128 and results["hf-gc"]["longest"] == 64, results


@pytest.mark.parametrize("limit", [100, 300, 10000])
def test_search_finds_the_boundary(limit):
    calls = []

    def fake(seq, left):
        calls.append(seq)
        return {"ok": seq <= limit, "oom": seq > limit}

    found = _util.longest(fake, 64, 16, 1 << 16, 60)
    assert found["longest"] == limit // 16 * 16 and found["first_failing"] == found["longest"] + 16
    assert found["stopped"] == "resolved to 16" and len(calls) == len(set(calls))
