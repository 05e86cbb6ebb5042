"""Activation bytes per token and tokens/s of one training step: the framework's memory variants side by side with
Hugging Face ``LlamaForCausalLM`` (with and without gradient checkpointing), same model, same machine, same run.

    python bench/activation_bytes.py                       # every row at 4096 and 16384 tokens
    python bench/activation_bytes.py --threads 1 --clock cpu --steps 3     # what docs/mst.md reports (shared host)
    python bench/activation_bytes.py --rows none,mst,hf_gc --seqs 1024,2048        # a quick look
    python bench/activation_bytes.py --row "memo_a05=memory.activation_offload=memo,memory.offload_fraction=0.5"

Memo rows also report ``host_bytes_per_token`` (the framework's count of its host copies) and
``device_activation_bytes_per_token`` = activation bytes per token - host bytes per token: on CPU the host copies
are in RSS, on GPU they would not be on the device.

Model: the tiny Llama (hidden 256, 4 layers, 8 heads, 2 kv heads, FFN 896, vocab 32000, untied), fp32, batch 1.
Each (row, sequence length) is measured in a **fresh process** that builds the model and runs training steps
(forward, backward, grad clip, AdamW; the framework through its own ``Trainer.train_step``, HF through the
equivalent plain loop). Peak RSS is read per phase: Linux resets the high-water mark with
``echo 5 > /proc/self/clear_refs``, so the worker records the peak of forward+backward and of the optimizer part of
the last step (Adam states already allocated, gradients freed by ``zero_grad``), and the process's lifetime peak.
Then per row, with lo/hi = 4096/16384:

    activation_bytes_per_token         = (peak_fwd_bwd@hi - peak_fwd_bwd@lo) / (hi - lo)     <- the headline
    activation_bytes_per_token_step    = same with the peak of the whole step
    activation_bytes_per_token_process = same with the process's lifetime peak (ru_maxrss)

Weights, gradients, optimizer state and the interpreter cancel out in the difference. The forward+backward peak is
the headline because once activations are small the whole-step peak is the optimizer's (AdamW temporaries, a
constant), and the difference then reads ~0 bytes/token -- flattering, and not a measurement of activations.
tokens/s is read at lo: lo / the fastest step after the first, from wall time (default) or from process CPU time
(``--clock cpu``; use it with ``--threads 1`` on a shared machine, where wall time measures the neighbours).
Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so glibc returns freed blocks of >= 64 KiB to the OS and RSS
follows live tensors instead of the heap's high-water mark (the same for every row). On CPU, RSS *is* the device
memory; on GPU one would read ``torch.cuda.max_memory_allocated`` per phase instead.

Rows are a table (``ROWS``): name -> ``Row(kind, overrides)``; framework rows are lists of ``--set`` overrides on
top of ``BASE``, so a later feature adds a row with one line (or ``--row name=k=v,k=v`` on the command line).
A framework row whose config is refused with ``ConfigError`` (a feature not merged yet) is reported as
``"available": false`` with the message; the benchmark goes on. ``target`` judges the first available of
``TARGET_ROWS`` against ``hf_gc``; ``target_device`` judges ``DEVICE_TARGET_ROW`` (host checkpoints in
mini-sequences) by its device bytes per token (RSS less the host checkpoints) against ``hf_gc``'s.

Output: one JSON object on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "bench", "activation_worker.py")

MODEL = dict(num_layers=4, hidden_size=256, ffn_hidden_size=896, num_attention_heads=8, num_query_groups=2,
             vocab_size=32000)
BASE = [f"model.{k}={v}" for k, v in MODEL.items()] + [
    "model.untie_embeddings_and_output_weights=true", "model.make_vocab_size_divisible_by=128",
    "data.mock_data=true", "train.micro_batch_size=1", "train.global_batch_size=1", "train.device=cpu",
    "train.lr=1e-4", "train.train_iters=100"]


@dataclass
class Row:
    kind: str  # "framework" | "hf"
    overrides: list = field(default_factory=list)  # framework: --set items; hf: ["gradient_checkpointing=true"]
    layer_checkpoint: bool = False  # framework only: wrap each layer in torch.utils.checkpoint (HF's scheme)
    note: str = ""


ROWS = {
    "none": Row("framework", [], note="no memory features"),
    "full_recompute": Row("framework", ["memory.recompute_granularity=full"],
                          note="token-wise: keeps layer input + attention output + lse, recomputes the token-wise rest"),
    "mst": Row("framework", ["memory.mst=true"], note="MsT: mini-sequence MLP and LM head + loss (defaults)"),
    "mst+full_recompute": Row("framework", ["memory.mst=true", "memory.recompute_granularity=full"]),
    "mst+full_recompute+chunks": Row("framework", ["memory.mst=true", "memory.recompute_granularity=full",
                                                   "memory.layer_chunk_size=1024"],
                                     note="+ the token-wise parts re-run in mini-sequences of 1024 tokens"),
    "mst+ckpt_offload": Row("framework", ["memory.mst=true", "memory.activation_offload=checkpoints"],
                            note="layer inputs on the host (in RSS on CPU), whole layer re-run in backward"),
    "mst+ckpt_offload+chunks": Row("framework", ["memory.mst=true", "memory.activation_offload=checkpoints",
                                                 "memory.layer_chunk_size=1024"],
                                   note="+ forward and re-run take the token-wise parts 1024 tokens at a time"),
    "layer_checkpoint": Row("framework", [], layer_checkpoint=True,
                            note="HF's scheme on our model, for comparison: torch.utils.checkpoint around each layer "
                                 "(keeps the layer input, recomputes the whole layer incl. attention)"),
    "mst+layer_checkpoint": Row("framework", ["memory.mst=true"], layer_checkpoint=True,
                                note="MsT + the per-layer torch.utils.checkpoint"),
    # ---- Memo offload (device-resident bytes: RSS minus the host copies, which live in RSS on CPU) ----
    "memo_a0": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=0"],
                   note="Memo: input + attention out offloaded, every other token recomputed"),
    "memo_a0.5": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=0.5"],
                     note="Memo: half the tokens of the other skeletal tensors offloaded, half recomputed"),
    "memo_a1": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=1"],
                   note="Memo: every skeletal tensor offloaded, nothing recomputed"),
    "mst+memo_a0": Row("framework", ["memory.mst=true", "memory.activation_offload=memo",
                                     "memory.offload_fraction=0"]),
    # ---- end Memo ---------------------------------------------------------------------------------------
    "hf": Row("hf", [], note="transformers LlamaForCausalLM, sdpa attention"),
    "hf_gc": Row("hf", ["gradient_checkpointing=true"], note="... with gradient_checkpointing_enable()"),
}
# the MsT + recompute row judged against the target, first available wins
TARGET_ROWS = ("mst+full_recompute",)
TARGET_BYTES_RATIO, TARGET_SPEED_RATIO = 20.0, 0.9
DEVICE_TARGET_ROW, DEVICE_TARGET_RATIO = "mst+ckpt_offload+chunks", 40.0


# ---- driver ------------------------------------------------------------------------------------------------------
def spec_for(row: Row, seq: int, steps: int, threads: int) -> dict:
    """The worker's complete instructions for one measurement."""
    spec = {"kind": row.kind, "seq": seq, "steps": steps, "threads": threads,
            "layer_checkpoint": row.layer_checkpoint}
    if row.kind == "hf":
        spec["hf"] = dict(MODEL, gradient_checkpointing="gradient_checkpointing=true" in row.overrides)
    else:
        spec["sets"] = BASE + [f"data.seq_length={seq}", f"model.max_position_embeddings={seq}"] + list(row.overrides)
    return spec


def measure(name: str, row: Row, seq: int, steps: int, args) -> dict:
    """Run one worker (fresh process); returns its JSON (``available: false`` + reason on refusal or failure)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold), PYTHONPATH=ROOT,
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, WORKER, json.dumps(spec_for(row, seq, steps, args.threads))], env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        res = {"available": False, "reason": f"worker failed (exit {proc.returncode}): {tail}"}
    else:
        res = json.loads(lines[-1])
    if res.get("available"):
        res["best_step_s"] = min(st[args.clock + "_s"] for st in (res["steps"][1:] or res["steps"]))
    print(f"[{time.perf_counter() - t0:6.1f}s] {name} @ {seq}: "
          + (f"peak fwd+bwd {res['peak_fwd_bwd'] / 2**20:.0f} MiB, step {res['peak_step'] / 2**20:.0f} MiB, "
             f"best step {res['best_step_s']:.2f} s ({args.clock})"
             if res.get("available") else f"unavailable: {res['reason']}"), file=sys.stderr, flush=True)
    return res


PEAKS = {"activation_bytes_per_token": "peak_fwd_bwd",  # headline: forward+backward of a steady-state step
         "activation_bytes_per_token_step": "peak_step",  # the whole step, optimizer included
         "activation_bytes_per_token_process": "peak_process"}  # the process's lifetime peak


def summarise(rows: dict, results: dict, rounds: dict, lo: int, hi: int) -> dict:
    """Per row: the three bytes/token figures, tokens/s at lo (best step over all measurements at lo), ratios to
    hf_gc / hf, and the median over speed rounds of the per-round speed ratio to hf_gc (paired: same round)."""
    table = {}
    for name, row in rows.items():
        r_lo, r_hi = results[name].get(lo, {}), results[name].get(hi, {})
        entry = {"kind": row.kind, "overrides": row.overrides, "note": row.note,
                 "layer_checkpoint": row.layer_checkpoint}
        if r_lo.get("available") and r_hi.get("available"):
            entry["available"] = True
            for metric, key in PEAKS.items():
                entry[metric] = (r_hi[key] - r_lo[key]) / (hi - lo)
                entry[key] = {lo: r_lo[key], hi: r_hi[key]}
            best = [r_lo["best_step_s"]] + [r["best_step_s"] for r in rounds.get(name, [])]
            entry.update(tokens_per_s=lo / min(best), best_step_seconds_at_lo=best,
                         steps_at_lo=r_lo["steps"], steps_at_hi=r_hi["steps"])
            if r_lo.get("memo") and r_hi.get("memo"):  # Memo: on CPU the host copies are part of RSS
                host = (r_hi["memo"]["host_bytes"] - r_lo["memo"]["host_bytes"]) / (hi - lo)
                entry.update(memo={lo: r_lo["memo"], hi: r_hi["memo"]}, host_bytes_per_token=host,
                             device_activation_bytes_per_token=entry["activation_bytes_per_token"] - host)
        else:
            entry.update(available=False, reason=(r_lo if not r_lo.get("available") else r_hi).get("reason"))
        table[name] = entry
    for ref in ("hf_gc", "hf"):
        if not table.get(ref, {}).get("available"):
            continue
        for name, e in table.items():
            if not e.get("available"):
                continue
            e[f"bytes_ratio_{ref}_over_this"] = (table[ref]["activation_bytes_per_token"]
                                                 / max(e["activation_bytes_per_token"], 1.0))
            if "device_activation_bytes_per_token" in e:  # offload rows: what stays on the device (see above)
                e[f"device_bytes_ratio_{ref}_over_this"] = (table[ref]["activation_bytes_per_token"]
                                                            / max(e["device_activation_bytes_per_token"], 1.0))
            e[f"speed_ratio_vs_{ref}"] = e["tokens_per_s"] / table[ref]["tokens_per_s"]
            paired = [b["best_step_s"] / a["best_step_s"] for a, b in zip(rounds.get(name, []), rounds.get(ref, []))]
            if paired:
                e[f"speed_ratio_vs_{ref}_paired_median"] = statistics.median(paired)
    target = {"rule": f"MsT + recompute: >= {TARGET_BYTES_RATIO}x fewer activation bytes/token than hf_gc at "
                      f">= {TARGET_SPEED_RATIO}x its tokens/s"}
    cand = next((n for n in TARGET_ROWS if table.get(n, {}).get("available")), None)
    if cand and table.get("hf_gc", {}).get("available"):
        e = table[cand]
        target.update(row=cand, bytes_ratio=e["bytes_ratio_hf_gc_over_this"], speed_ratio=e["speed_ratio_vs_hf_gc"],
                      met=e["bytes_ratio_hf_gc_over_this"] >= TARGET_BYTES_RATIO
                      and e["speed_ratio_vs_hf_gc"] >= TARGET_SPEED_RATIO)
    else:
        target["met"] = None
    return {"rows": table, "target": target, "target_device": _device_target(table)}


def _device_target(table: dict) -> dict:
    """The long-context target (host checkpoints in mini-sequences): >= 40x fewer *device* activation bytes per token
    than hf_gc (RSS less the host checkpoints, which a GPU keeps off the device) at >= 0.9x its tokens/s."""
    row, ref = DEVICE_TARGET_ROW, table.get("hf_gc", {})
    out = {"rule": f"{row}: >= {DEVICE_TARGET_RATIO}x fewer device activation bytes/token than hf_gc at >= "
                   f"{TARGET_SPEED_RATIO}x its tokens/s", "row": row, "met": None}
    e = table.get(row, {})
    if e.get("available") and ref.get("available") and "device_bytes_ratio_hf_gc_over_this" in e:
        out.update(bytes_ratio=e["device_bytes_ratio_hf_gc_over_this"], speed_ratio=e["speed_ratio_vs_hf_gc"],
                   met=e["device_bytes_ratio_hf_gc_over_this"] >= DEVICE_TARGET_RATIO
                   and e["speed_ratio_vs_hf_gc"] >= TARGET_SPEED_RATIO)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names (default: all)")
    p.add_argument("--row", action="append", default=[], metavar="NAME=K=V,K=V",
                   help="add a framework row: name and --set overrides, comma-separated")
    p.add_argument("--seqs", default="4096,16384", help="the two sequence lengths (low,high)")
    p.add_argument("--steps", type=int, default=2,
                   help="training steps per measurement at the low length (the first one untimed; the high length "
                        "runs at most 2: its peak is read at the last step)")
    p.add_argument("--speed-rounds", type=int, default=0,
                   help="extra rounds at the low length, all rows interleaved, for tokens/s only")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="tokens/s from wall time, or from process CPU time (steadier on a shared machine)")
    p.add_argument("--mmap-threshold", type=int, default=65536)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per measurement")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    rows = {}
    for n in [n for n in args.rows.split(",") if n]:
        if n not in ROWS:
            sys.exit(f"unknown row '{n}'; rows: {', '.join(ROWS)}")
        rows[n] = ROWS[n]
    for item in args.row:
        name, _, sets = item.partition("=")
        rows[name] = Row("framework", [s for s in sets.split(",") if s], note="from --row")
    lo, hi = (int(s) for s in args.seqs.split(","))
    results = {n: {} for n in rows}
    for seq, steps in ((lo, args.steps), (hi, min(args.steps, 2))):  # one length for all rows, then the other
        for name, row in rows.items():
            if seq == hi and not results[name][lo].get("available"):
                results[name][hi] = results[name][lo]
                continue
            results[name][seq] = measure(name, row, seq, steps, args)
    rounds = {n: [] for n in rows if results[n][lo].get("available")}
    for _ in range(args.speed_rounds):
        for name in rounds:
            r = measure(name, rows[name], lo, max(args.steps, 2), args)
            if r.get("available"):
                rounds[name].append(r)
    out = {"model": MODEL, "seqs": [lo, hi], "steps": args.steps, "speed_rounds": args.speed_rounds,
           "threads": args.threads, "clock": args.clock, "malloc_mmap_threshold": args.mmap_threshold,
           "command": " ".join(["bench/activation_bytes.py"] + (argv if argv is not None else sys.argv[1:]))}
    out.update(summarise(rows, results, rounds, lo, hi))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
