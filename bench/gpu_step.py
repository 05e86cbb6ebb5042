"""The GPU check's training step (``scripts/gpu_check.sh``, part 3): Llama3-8B cut to a few layers on one GPU, at the
longest sequence the estimator says that GPU holds within the time the check gives a step, its measured peak beside
the estimator's and the rehearsal's figures for the very same config.

    python bench/gpu_step.py pick --gpu "NVIDIA H100 80GB HBM3" --memory-gib 79.6   # the length and the --set items
    python bench/gpu_step.py rehearse --plan P.json --out R.json   # the rehearsal of it (CPU, fake tensors)
    python bench/gpu_step.py measure --plan P.json --rehearsal R.json --out M.json   # two steps on the GPU

The one-GPU layout is the one the rehearsal's 512K case uses (``docs/rehearsal.md``, case c): the layer inputs on
the host (``activation_offload: checkpoints``) re-run in 16K mini-sequences, MsT, FSDP2 with its states on the host;
``pick`` tries 1M down to 64K tokens and takes the longest whose estimated peak (with its fragmentation reserve) fits
the GPU's profile and whose estimated step takes at most ``--step-s`` seconds. ``MEGATRON_LC_GPU_DRYRUN=1``: the
same three steps on the CPU with a tiny model of the same shape family (no device peak is measured there). Each
prints one JSON object and writes it to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config import load_config  # noqa: E402  (after the path)
from megatron_lc.estimate import estimate, load_hardware  # noqa: E402
from megatron_lc.estimate.hardware import profile_for_gpu  # noqa: E402

DRYRUN = os.environ.get("MEGATRON_LC_GPU_DRYRUN") == "1"
CONFIG = os.path.join(ROOT, "configs", "llama3_8b_1m.yaml")
LAYERS = 4
ONE_GPU = ["parallel.context_parallel_size=1", "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1",
           "parallel.tensor_model_parallel_size=1", "parallel.fsdp_cpu_offload=true",
           "memory.activation_offload=checkpoints", "memory.layer_chunk_size=16384", "memory.mst=true",
           "memory.offload_fraction=auto", "train.global_batch_size=1", "checkpoint.save="]
TINY = ["model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_query_groups=2", "model.vocab_size=256", "memory.layer_chunk_size=64"]
LENGTHS = [1 << 20, 786432, 1 << 19, 393216, 1 << 18, 131072, 65536]


def config_sets(seq: int) -> list:
    """The ``--set`` items that make ``CONFIG`` the check's one-GPU cut at ``seq`` tokens."""
    return [f"model.num_layers={LAYERS}", f"data.seq_length={seq}", f"model.max_position_embeddings={seq}"] + \
        ONE_GPU + (TINY if DRYRUN else [])


def pick(profile: str, step_s: float) -> dict:
    """The longest of ``LENGTHS`` that fits ``profile`` by the estimator within ``step_s`` seconds a step."""
    hw = load_hardware(profile)
    tried = []
    for seq in ([256] if DRYRUN else LENGTHS):
        sets = config_sets(seq)
        est = estimate(load_config(CONFIG, sets), hw, 1)
        row = {"seq": seq, "estimated_peak_bytes": est.memory.peak, "allocated_peak_bytes": est.memory.allocated_peak,
               "step_s": est.time.step_seconds, "usable_bytes": hw.device_bytes}
        tried.append(row)
        if DRYRUN or (est.memory.peak <= hw.device_bytes and est.time.step_seconds <= step_s):
            return {"config": CONFIG, "sets": sets, "profile": profile, "layers": LAYERS, **row, "tried": tried}
    return {"config": CONFIG, "sets": None, "profile": profile, "tried": tried,
            "error": f"no length of {LENGTHS} fits {profile} within {step_s} s a step"}


def rehearse(plan: dict, out: str) -> dict:
    """``tools/rehearse.py`` of the plan's config, two steps, rank 0 of 1 (its JSON: the rehearsed peak and the
    estimator's beside it)."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "rehearse.py"), "--config", plan["config"], "--ranks", "0",
           "--steps", "2", "--steps-only", "--nproc-per-node", "1", "--out", out] + \
        [x for s in plan["sets"] for x in ("--set", s)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    res = {"returncode": r.returncode, "summary": last}
    if os.path.exists(out):
        with open(out) as f:
            summary = json.load(f)["summary"]
        res.update({"peak_device_bytes": summary["max_peak_device_bytes"], "moment": summary["max_peak_moment"],
                    "estimator_peak_bytes": summary["estimator_peak_bytes"], "difference": summary["difference"]})
    else:
        res["error"] = (r.stderr.strip().splitlines() or [last])[-1][:300]
    return res


def measure(plan: dict, rehearsal: dict) -> dict:
    """Two steps of the plan's config on the GPU in a fresh process (``bench/gpu_worker.py``), the measured peak
    allocated beside the rehearsal's peak and the estimator's allocated peak."""
    spec = {"kind": "framework", "device": "cpu" if DRYRUN else "cuda", "seq": plan["seq"], "steps": 2,
            "bf16": not DRYRUN, "config": plan["config"], "sets": plan["sets"]}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_worker.py"), json.dumps(spec)],
                       capture_output=True, text=True)
    line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("GPU_WORKER_RESULT ")), None)
    worker = json.loads(line[len("GPU_WORKER_RESULT "):]) if line else {
        "ok": False, "error": (r.stderr.strip().splitlines() or ["no result"])[-1][:300]}
    measured = worker.get("max_allocated_bytes")
    out = {"seq": plan["seq"], "layers": plan["layers"], "measured": worker,
           "estimator_allocated_peak_bytes": plan["allocated_peak_bytes"],
           "rehearsed_peak_bytes": rehearsal.get("peak_device_bytes")}
    for key, figure in (("vs_estimator", plan["allocated_peak_bytes"]), ("vs_rehearsal", out["rehearsed_peak_bytes"])):
        out[key] = (measured - figure) / figure if measured and figure else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["pick", "rehearse", "measure"])
    p.add_argument("--gpu", default="H100")
    p.add_argument("--memory-gib", type=float, default=80.0)
    p.add_argument("--step-s", type=float, default=45.0, help="the longest estimated step the check gives time to")
    p.add_argument("--plan")
    p.add_argument("--rehearsal")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.what == "pick":
        profile = profile_for_gpu(a.gpu, a.memory_gib) or os.path.join(ROOT, "configs", "hardware", "h100.yaml")
        res = pick(profile, a.step_s)
    else:
        with open(a.plan) as f:
            plan = json.load(f)
        if plan.get("sets") is None:
            res = {"error": "no plan: " + plan.get("error", "?")}
        elif a.what == "rehearse":
            res = rehearse(plan, a.out + ".report.json")
        else:
            rehearsal = {}
            if a.rehearsal and os.path.exists(a.rehearsal):
                with open(a.rehearsal) as f:
                    rehearsal = json.load(f)
            res = measure(plan, rehearsal)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
