"""The whole training process as a user sees it: peak RSS of ``pretrain_gpt.py`` running one step against a
Hugging Face one-step script, same model, same lengths, a fresh process per point, default allocator settings (so
fragmentation, the interpreter, data and everything outside the layers count too).

    python bench/process_rss.py                       # 4096 and 16384 tokens (~6-10 minutes on 2 cores)
    python bench/process_rss.py --seqs 1024,4096      # a quick look

Model: the tiny Llama of ``bench/activation_bytes.py`` (hidden 256, 4 layers, 8 / 2 heads, FFN 896, vocab 32000,
untied), fp32, batch 1, one training step (forward, backward, clip, AdamW). Ours: ``pretrain_gpt.py`` as one process
(mock data, no checkpoint, no metrics file) with each option set of ``OURS``; HF: ``LlamaForCausalLM`` (sdpa) with
gradient checkpointing, the loop of ``bench/activation_worker.py``. Peak RSS is the child's ``ru_maxrss`` (read in
the child at exit). Per row: ``bytes_per_token = (peak@hi - peak@lo) / (hi - lo)`` (the interpreter and the weights
cancel), and the ratio to HF's. On CPU the host copies of Memo / host checkpoints are in RSS too.

Caveat (measured 2026-11-23, ``bench/results/process_rss_2026-11-23.json``): one step's lifetime peak has a floor,
the first optimizer step (AdamW states + gradients: ~815-820 MiB for this model). Where our peak sits on that floor
(4K for every row, 8K for the chunked one) the slope understates our activation bytes and the ratio to HF is an
upper bound: compare the raw peaks at the high length (16K: HF + gradient checkpointing 6,777-6,881 MiB, MsT + full
recompute 1,349-1,409, + 1024-token mini-sequences 904-916, host checkpoints 1,110-1,307). Above the floor,
``--seqs 16384,32768`` (``bench/results/process_rss_16k32k_2026-11-23.json``, ours twice): HF + gradient
checkpointing 380 KB per token; host checkpoints in 1024-token mini-sequences 5.1-5.7 KB (67-75x less), MsT + full
recompute in mini-sequences 7.0-11.4 KB (33-55x); single points move by tens of MiB with the default allocator.

Output: one JSON object on stdout (progress on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.activation_bytes import BASE, MODEL  # noqa: E402  (the same model as the activation benchmark)

OURS = {
    "mst+full_recompute": ["memory.mst=true", "memory.recompute_granularity=full"],
    "mst+full_recompute+chunks": ["memory.mst=true", "memory.recompute_granularity=full",
                                  "memory.layer_chunk_size=1024"],
    "mst+ckpt_offload": ["memory.mst=true", "memory.activation_offload=checkpoints"],
    "mst+ckpt_offload+chunks": ["memory.mst=true", "memory.activation_offload=checkpoints",
                                "memory.layer_chunk_size=1024"],
}
# the child: run a script or an inline program, then print its own peak RSS (bytes) as the last line
WRAP = ("import atexit, resource, runpy, sys\n"
        "atexit.register(lambda: print('MAXRSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,"
        " flush=True))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n")
HF = '''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
seq, m = int(sys.argv[1]), {model}
torch.manual_seed(1234)
c = LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                num_key_value_heads=m["num_query_groups"], max_position_embeddings=seq, tie_word_embeddings=False,
                use_cache=False, attn_implementation="sdpa")
model = LlamaForCausalLM(c).float().train()
model.gradient_checkpointing_enable()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, m["vocab_size"], (1, seq))
loss = model(input_ids=ids, labels=ids, use_cache=False).loss
loss.backward()
torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
opt.step()
'''


def run(argv: list, threads: int) -> int:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", WRAP] + argv, env=env, capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MAXRSS")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{argv[:2]} failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return int(lines[-1].split()[1])


def ours(sets: list, seq: int, threads: int) -> int:
    over = BASE + [f"data.seq_length={seq}", f"model.max_position_embeddings={seq}", "train.train_iters=1",
                   "checkpoint.save=null", "logging.metrics_file=null"] + sets
    argv = [os.path.join(ROOT, "pretrain_gpt.py"), "--config", os.path.join(ROOT, "configs", "tiny_cpu.yaml")]
    for o in over:
        argv += ["--set", o]
    return run(argv, threads)


def hf(seq: int, threads: int, tmp: str) -> int:
    path = os.path.join(tmp, "hf_one_step.py")
    with open(path, "w") as f:
        f.write(HF.format(model=repr(MODEL)))
    return run([path, str(seq)], threads)


def main(argv=None) -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seqs", default="4096,16384")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default=",".join(["hf_gc", *OURS]),
                   help="comma-separated rows (hf_gc and those of OURS); without hf_gc no ratio is computed")
    args = p.parse_args(argv)
    names = args.rows.split(",")
    unknown = [n for n in names if n != "hf_gc" and n not in OURS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; rows: hf_gc, {', '.join(OURS)}")
    lo, hi = (int(s) for s in args.seqs.split(","))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            peaks = {}
            for seq in (lo, hi):
                peaks[seq] = hf(seq, args.threads, tmp) if name == "hf_gc" else ours(OURS[name], seq, args.threads)
                print(f"{name} @ {seq}: peak RSS {peaks[seq] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
            rows[name] = {"peak_rss_bytes": peaks, "bytes_per_token": (peaks[hi] - peaks[lo]) / (hi - lo)}
    ref = rows["hf_gc"]["bytes_per_token"] if "hf_gc" in rows else None
    for name, r in rows.items():
        if ref is not None:
            r["hf_over_ours"] = round(ref / r["bytes_per_token"], 2) if r["bytes_per_token"] > 0 else None
    print(json.dumps({"model": MODEL, "seqs": [lo, hi], "threads": args.threads, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
