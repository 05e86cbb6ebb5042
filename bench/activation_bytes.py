"""Activation bytes per token and tokens/s of one training step: the framework's memory variants side by side with
Hugging Face ``LlamaForCausalLM`` (with and without gradient checkpointing), same model, same machine, same run.

    python bench/activation_bytes.py                       # every row, sequences 4096 and 16384 (~30-60 min, 2 cores)
    python bench/activation_bytes.py --rows none,mst,hf_gc --seqs 1024,2048   # a quick look
    python bench/activation_bytes.py --row "memo_a05=memory.activation_offload=memo,memory.offload_fraction=0.5"

Memo rows (issue 6) also report ``host_bytes_per_token`` (the framework's count of its host copies) and
``device_activation_bytes_per_token`` = activation bytes per token - host bytes per token: on CPU the host copies
are in RSS, on GPU they would not be on the device.

Model: the tiny Llama (hidden 256, 4 layers, 8 heads, 2 kv heads, FFN 896, vocab 32000, untied), fp32, batch 1.
Each (row, sequence) is measured in a **fresh process** that builds the model, runs ``--steps`` training steps
(forward, backward, grad clip, AdamW; the framework through its own ``Trainer.train_step``) and reports its peak
RSS (``ru_maxrss``). Then per row:

    activation_bytes_per_token = (peak_rss@16384 - peak_rss@4096) / (16384 - 4096)

(weights, grads, optimizer state and the interpreter cancel out), and tokens/s at 4096 = 4096 / the fastest step
after the first. Ratios are against ``hf_gc`` (and ``hf``). Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` so
glibc returns freed blocks of >= 64 KiB to the OS and RSS follows live tensors instead of the heap high-water mark
(the same for every row). On CPU, RSS *is* the device memory; on GPU one would read ``max_memory_allocated``.

Rows are a table (``ROWS``): a name -> ``Row(kind, overrides)``; framework rows are lists of ``--set`` overrides on
top of ``BASE``, so a later feature adds a row with one line (or ``--row name=k=v,k=v`` on the command line).
A framework row whose config is refused with ``ConfigError`` (a feature not merged yet) is reported as
``"available": false`` with the message; the benchmark does not stop.

Output: one JSON object on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    layer_checkpoint: bool = False  # framework only: wrap each layer in torch.utils.checkpoint (temporary baseline)
    note: str = ""


ROWS = {
    "none": Row("framework", [], note="no memory features"),
    "full_recompute": Row("framework", ["memory.recompute_granularity=full"],
                          note="issue 6: keeps layer input + attention output + lse, recomputes the token-wise rest"),
    "mst": Row("framework", ["memory.mst=true"], note="MsT: mini-sequence MLP and LM head + loss (defaults)"),
    "mst+full_recompute": Row("framework", ["memory.mst=true", "memory.recompute_granularity=full"]),
    "tmp_layer_checkpoint": Row("framework", [], layer_checkpoint=True,
                                note="TEMPORARY baseline until issue 6: torch.utils.checkpoint around each layer "
                                     "(keeps the layer input, recomputes the whole layer incl. attention)"),
    "mst+tmp_layer_checkpoint": Row("framework", ["memory.mst=true"], layer_checkpoint=True,
                                    note="MsT + the temporary per-layer checkpoint"),
    # ---- issue 6: Memo offload (device-resident bytes: RSS minus the host copies, which live in RSS on CPU) ----
    "memo_a0": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=0"],
                   note="Memo: input + attention out offloaded, every other token recomputed"),
    "memo_a0.5": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=0.5"],
                     note="Memo: half the tokens of the other skeletal tensors offloaded, half recomputed"),
    "memo_a1": Row("framework", ["memory.activation_offload=memo", "memory.offload_fraction=1"],
                   note="Memo: every skeletal tensor offloaded, nothing recomputed"),
    "mst+memo_a0": Row("framework", ["memory.mst=true", "memory.activation_offload=memo",
                                     "memory.offload_fraction=0"]),
    # ---- end issue 6 ---------------------------------------------------------------------------------------
    "hf": Row("hf", [], note="transformers LlamaForCausalLM, sdpa attention"),
    "hf_gc": Row("hf", ["gradient_checkpointing=true"], note="... with gradient_checkpointing_enable()"),
}
# the MsT + recompute row judged against the target, first available wins
TARGET_ROWS = ("mst+full_recompute", "mst+tmp_layer_checkpoint")
TARGET_BYTES_RATIO, TARGET_SPEED_RATIO = 20.0, 0.9


# ---- worker: one measurement in this (fresh) process ---------------------------------------------------------------
class PeakMeter:
    """Peak RSS of a phase: Linux resets the high-water mark on ``echo 5 > /proc/self/clear_refs``; elsewhere the
    process-lifetime ``ru_maxrss`` is used (then phases cannot be separated)."""

    def __init__(self) -> None:
        self.lifetime = 0  # the process's peak across resets
        try:
            with open("/proc/self/status"):
                pass
            self.resettable = True
        except OSError:
            self.resettable = False

    def reset(self) -> None:
        self.lifetime = max(self.lifetime, self.peak())
        if self.resettable:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    @staticmethod
    def peak() -> int:
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(r if sys.platform == "darwin" else r * 1024)


class StepRecorder:
    """Per step: wall and CPU seconds, peak RSS of forward+backward (reset at its start, read at its end) and of
    the whole step (reset at the step's start), loss."""

    def __init__(self) -> None:
        self.meter, self.steps = PeakMeter(), []

    def start_step(self) -> None:
        self.meter.reset()
        self.cur = {"t0": time.perf_counter(), "c0": time.process_time()}

    def start_fwd_bwd(self) -> None:
        self.meter.reset()

    def end_fwd_bwd(self) -> None:
        self.cur["peak_fwd_bwd"] = self.meter.peak()
        self.meter.reset()

    def end_step(self, loss: float) -> None:
        c = self.cur
        self.steps.append({"wall_s": time.perf_counter() - c["t0"], "cpu_s": time.process_time() - c["c0"],
                           "peak_fwd_bwd": c["peak_fwd_bwd"], "peak_optimizer": self.meter.peak(),
                           "loss": loss})


def _framework_steps(row: Row, seq: int, steps: int, metrics_file: str, rec: StepRecorder):
    sys.path.insert(0, ROOT)
    import torch

    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    sets = BASE + [f"data.seq_length={seq}", f"model.max_position_embeddings={seq}",
                   f"logging.metrics_file={metrics_file}"] + list(row.overrides)
    try:
        trainer = Trainer(load_config(None, sets), Topology(), torch.device("cpu"))
    except ConfigError as e:
        return str(e)
    if row.layer_checkpoint:
        _checkpoint_layers(trainer.model)
    fwd_bwd = trainer.forward_backward

    rt = getattr(trainer.model, "memo_runtime", None)  # issue 6: Memo's own accounting, when present

    def measured_fwd_bwd(batches):  # Trainer.train_step calls self.forward_backward: bracket it
        if rt is not None:
            rt.account.reset_peak()
        rec.start_fwd_bwd()
        out = fwd_bwd(batches)
        rec.end_fwd_bwd()
        return out

    trainer.forward_backward = measured_fwd_bwd
    for step in range(steps):
        rec.start_step()
        out = trainer.train_step(step)
        rec.end_step(out["loss"])
    if rt is not None:
        rec.memo = {"host_bytes": rt.host_bytes(), "accounted_peak_bytes": rt.account.peak, "alpha": rt.alpha,
                    "rounding_buffer_bytes": 2 * rt.buffers[0].capacity if rt.buffers[0] is not None else 0}
    return None


def _checkpoint_layers(model) -> None:
    """TEMPORARY baseline (until issue 6's recompute lands): run every transformer layer under non-reentrant
    ``torch.utils.checkpoint`` -- what HF's gradient checkpointing does, so this row is HF's scheme on our model."""
    import torch.utils.checkpoint as cp

    for layer in model.layers:
        fwd = layer.forward
        layer.forward = lambda x, rope, fwd=fwd: cp.checkpoint(fwd, x, rope, use_reentrant=False)


def _hf_steps(row: Row, seq: int, steps: int, rec: StepRecorder) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    c = LlamaConfig(vocab_size=MODEL["vocab_size"], hidden_size=MODEL["hidden_size"],
                    intermediate_size=MODEL["ffn_hidden_size"], num_hidden_layers=MODEL["num_layers"],
                    num_attention_heads=MODEL["num_attention_heads"],
                    num_key_value_heads=MODEL["num_query_groups"], max_position_embeddings=seq,
                    rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, use_cache=False,
                    attn_implementation="sdpa")
    model = LlamaForCausalLM(c).float().train()
    if "gradient_checkpointing=true" in row.overrides:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(steps):
        ids = torch.randint(0, MODEL["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(step))
        rec.start_step()
        opt.zero_grad(set_to_none=True)
        rec.start_fwd_bwd()
        out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss
        del out  # do not keep the full logits alive through backward (what a lean HF loop does)
        loss.backward()
        rec.end_fwd_bwd()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec.end_step(float(loss))


def worker(spec: dict) -> dict:
    import tempfile

    import torch

    torch.set_num_threads(spec["threads"])
    row = Row(**spec["row"])
    rec = StepRecorder()
    if row.kind == "hf":
        _hf_steps(row, spec["seq"], spec["steps"], rec)
    else:
        with tempfile.TemporaryDirectory() as d:
            err = _framework_steps(row, spec["seq"], spec["steps"], os.path.join(d, "metrics.jsonl"), rec)
        if err is not None:
            return {"available": False, "reason": err}
    last = rec.steps[-1]  # Adam states exist and grads were freed by zero_grad: the steady state
    timed = rec.steps[1:] or rec.steps
    clock = "cpu_s" if spec["clock"] == "cpu" else "wall_s"
    return {"available": True, "peak_fwd_bwd": last["peak_fwd_bwd"],
            "peak_step": max(last["peak_fwd_bwd"], last["peak_optimizer"]),
            "peak_process": max(rec.meter.lifetime, PeakMeter.peak()),
            "peak_resettable": rec.meter.resettable, "steps": rec.steps,
            "tokens_per_s": spec["seq"] / min(s[clock] for s in timed), "memo": getattr(rec, "memo", None)}


# ---- driver ------------------------------------------------------------------------------------------------------
def measure(name: str, row: Row, seq: int, args) -> dict:
    steps = args.steps if seq == args.lo else min(args.steps, 2)  # speed is read at the low length only
    spec = {"row": asdict(row), "seq": seq, "steps": steps, "threads": args.threads, "clock": args.clock}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(args.mmap_threshold), PYTHONPATH=ROOT,
               TRANSFORMERS_VERBOSITY="error", TOKENIZERS_PARALLELISM="false")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        res = {"available": False, "reason": f"worker failed (exit {proc.returncode}): {tail}"}
    else:
        res = json.loads(lines[-1])
    print(f"[{time.perf_counter() - t0:6.1f}s] {name} @ {seq}: "
          + (f"peak fwd+bwd {res['peak_fwd_bwd'] / 2**20:.0f} MiB, step {res['peak_step'] / 2**20:.0f} MiB, "
             f"{res['tokens_per_s']:.0f} tok/s ({args.clock})"
             if res.get("available") else f"unavailable: {res['reason']}"), file=sys.stderr, flush=True)
    return res


PEAKS = {"activation_bytes_per_token": "peak_fwd_bwd",  # headline: forward+backward of a steady-state step
         "activation_bytes_per_token_step": "peak_step",  # the whole step, optimizer included
         "activation_bytes_per_token_process": "peak_process"}  # the process's lifetime peak


def summarise(rows: dict, results: dict, lo: int, hi: int) -> dict:
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
            entry.update(tokens_per_s=r_lo["tokens_per_s"], steps_at_lo=r_lo["steps"], steps_at_hi=r_hi["steps"])
            if r_lo.get("memo") and r_hi.get("memo"):  # issue 6: on CPU the host copies are part of RSS
                host = (r_hi["memo"]["host_bytes"] - r_lo["memo"]["host_bytes"]) / (hi - lo)
                entry.update(memo={lo: r_lo["memo"], hi: r_hi["memo"]}, host_bytes_per_token=host,
                             device_activation_bytes_per_token=entry["activation_bytes_per_token"] - host)
        else:
            entry.update(available=False, reason=(r_lo if not r_lo.get("available") else r_hi).get("reason"))
        table[name] = entry
    for ref in ("hf_gc", "hf"):
        if table.get(ref, {}).get("available"):
            for e in table.values():
                if e.get("available"):
                    e[f"bytes_ratio_{ref}_over_this"] = (table[ref]["activation_bytes_per_token"]
                                                         / max(e["activation_bytes_per_token"], 1.0))
                    e[f"speed_ratio_vs_{ref}"] = e["tokens_per_s"] / table[ref]["tokens_per_s"]
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
    return {"rows": table, "target": target}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names (default: all)")
    p.add_argument("--row", action="append", default=[], metavar="NAME=K=V,K=V",
                   help="add a framework row: name and --set overrides, comma-separated")
    p.add_argument("--seqs", default="4096,16384", help="the two sequence lengths (low,high)")
    p.add_argument("--steps", type=int, default=2,
                   help="training steps per measurement at the low length (the first one untimed; the high length "
                        "runs at most 2: its peak is read at the last step)")
    p.add_argument("--threads", type=int, default=2, help="torch threads per worker")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="tokens/s from wall time, or from process CPU time (steadier on a shared machine)")
    p.add_argument("--mmap-threshold", type=int, default=65536)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per measurement")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    rows = {}
    for n in [n for n in args.rows.split(",") if n]:
        if n not in ROWS:
            sys.exit(f"unknown row '{n}'; rows: {', '.join(ROWS)}")
        rows[n] = ROWS[n]
    for item in args.row:
        name, _, sets = item.partition("=")
        rows[name] = Row("framework", [s for s in sets.split(",") if s], note="from --row")
    lo, hi = (int(s) for s in args.seqs.split(","))
    args.lo = lo
    results = {n: {} for n in rows}
    for seq in (lo, hi):  # all rows at one length, then the other: load drifts hit every row alike
        for name, row in rows.items():
            if seq == hi and not results[name][lo].get("available"):
                results[name][hi] = results[name][lo]
                continue
            results[name][seq] = measure(name, row, seq, args)
    out = {"model": MODEL, "seqs": [lo, hi], "steps": args.steps, "threads": args.threads, "clock": args.clock,
           "malloc_mmap_threshold": args.mmap_threshold, "command": " ".join([os.path.basename(sys.argv[0])]
                                                                             + (argv or sys.argv[1:]))}
    out.update(summarise(rows, results, lo, hi))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
