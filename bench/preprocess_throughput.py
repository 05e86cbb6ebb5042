"""Tokens per second of ``tools/preprocess_data.py`` at 1 and 2 workers on the same corpus, side by side.

    python bench/preprocess_throughput.py [--repeats 2] [--copies 2] > bench/results/preprocess_throughput_DATE.json

The corpus: the Python standard library's sources (``data/demo.py``'s file list), ``--copies`` times, as one
``.jsonl.gz``; the tokenizer: a Llama-3-style byte-level BPE of 2,000 ids trained here with ``tokenizers``
(``tools/stand_ins.py``), through ``HuggingFaceTokenizer``. Each setting runs ``--repeats`` times, alternating;
the best run of each counts (the least disturbed by other processes on the machine). Both outputs must be the same
bytes. ``ratio``: tokens/s at 2 workers over 1; the machine's cores are printed beside it (a ratio near 2 needs two
idle cores).
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--copies", type=int, default=2)
    args = ap.parse_args()
    from megatron_lc.data.demo import read_documents, stdlib_source_files
    from tools.stand_ins import llama3_tokenizer, write_jsonl

    with tempfile.TemporaryDirectory() as tmp:
        tok = llama3_tokenizer(os.path.join(tmp, "tok"), vocab_size=2000)
        docs = read_documents(stdlib_source_files()) * args.copies
        corpus = write_jsonl(os.path.join(tmp, "corpus.jsonl.gz"), docs)
        runs = {1: [], 2: []}
        for _ in range(args.repeats):
            for w in (1, 2):
                out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                                      corpus, "--tokenizer-model", tok, "--output-prefix", os.path.join(tmp, f"w{w}"),
                                      "--append-eod", "--workers", str(w)], capture_output=True, text=True,
                                     env=dict(os.environ, PYTHONPATH=ROOT), check=True)
                runs[w].append(json.loads(out.stdout.strip().splitlines()[-1]))
        same = filecmp.cmp(os.path.join(tmp, "w1.bin"), os.path.join(tmp, "w2.bin"), shallow=False)
    best = {w: max(r, key=lambda x: x["tokens_per_s"]) for w, r in runs.items()}
    print(json.dumps({
        "corpus": f"Python stdlib sources x{args.copies} (.jsonl.gz)", "documents": best[1]["documents"],
        "tokens": best[1]["tokens"], "tokenizer": "byte-level BPE, 2000 ids (HuggingFaceTokenizer)",
        "cpu_count": os.cpu_count(), "load_average_1min": os.getloadavg()[0],
        "tokens_per_s": {f"workers_{w}": b["tokens_per_s"] for w, b in best.items()},
        "all_runs_tokens_per_s": {f"workers_{w}": [x["tokens_per_s"] for x in r] for w, r in runs.items()},
        "ratio_2_over_1": round(best[2]["tokens_per_s"] / best[1]["tokens_per_s"], 3),
        "outputs_identical": same,
    }, indent=1))


if __name__ == "__main__":
    main()
