"""Answer-only fine-tuning against training on every token, side by side, on conversations whose answer is one fixed
sentence after a random prompt (tests/support/sft_behaviour.py; its cheap twin: tests/training/test_sft_behaviour.py).

    python bench/sft_behaviour.py [--conversations 400] [--steps 80] [--seq 256] [--out bench/results/x.json]

A tiny Llama-3-style tokenizer and chat template made here, the conversations rendered by
``tools/preprocess_data.py --chat``; the same tokens written once more with a loss mask of ones; the tiny model
(2 layers, hidden 64) trained on each from the same initialisation, one process on the CPU, packed conversations
(each its own document). Printed: the training loss every few steps of both runs and their ratio, and afterwards each
model's loss on the answers alone. JSON on stdout (and ``--out``), the table on stderr."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.support.sft_behaviour import answer_loss, make_corpora, train  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    run = [f"data.seq_length={a.seq}", "train.micro_batch_size=4", "train.global_batch_size=4", f"train.lr={a.lr}"]
    with tempfile.TemporaryDirectory() as tmp:
        corpora = make_corpora(tmp, a.conversations)
        result = {"conversations": a.conversations, "steps": a.steps, "seq_length": a.seq, "lr": a.lr,
                  "preprocess": json.loads(corpora["summary"])}
        for which in ("answers", "every"):
            t0 = time.perf_counter()
            losses, trainer = train(corpora, which, a.steps, run)
            result[which] = {"losses": losses, "seconds": round(time.perf_counter() - t0, 1),
                             "loss_on_answers": answer_loss(corpora, trainer, run)}
    result["preprocess"].pop("output_prefix")
    result["preprocess"].pop("loss_mask")
    every = max(1, a.steps // 10)
    print(f"{'step':>5} {'answers only':>13} {'every token':>12} {'ratio':>7}", file=sys.stderr)
    for i in list(range(0, a.steps, every)) + [a.steps - 1]:
        x, y = result["answers"]["losses"][i], result["every"]["losses"][i]
        print(f"{i + 1:>5} {x:>13.4f} {y:>12.4f} {y / x:>7.2f}", file=sys.stderr)
    x, y = result["answers"]["loss_on_answers"], result["every"]["loss_on_answers"]
    print(f"loss on the answers afterwards: answers-only model {x:.4f}, every-token model {y:.4f} (ratio {y / x:.2f})",
          file=sys.stderr)
    text = json.dumps(result)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
