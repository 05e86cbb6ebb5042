"""Train a SentencePiece (BPE) tokenizer.

    python tools/train_tokenizer.py --input a.txt b.jsonl --vocab-size 8000 --out data/my_sp8k
    python tools/train_tokenizer.py --stdlib --vocab-size 8000 --out data/stdlib_py_sp8k   # the demo corpus

``.jsonl`` inputs use their ``text`` field; other files are read as text. Writes OUT.model and OUT.vocab."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def iter_texts(paths):
    for p in paths:
        if p.endswith(".jsonl"):
            with open(p, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        yield json.loads(line)["text"]
        else:
            with open(p, encoding="utf-8", errors="replace") as f:
                yield f.read()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="*", default=[], help="text or .jsonl files")
    ap.add_argument("--stdlib", action="store_true", help="use the Python standard library sources (demo corpus)")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--out", required=True, help="output prefix (OUT.model, OUT.vocab)")
    args = ap.parse_args(argv)
    from megatron_lc.data.demo import stdlib_source_files
    from megatron_lc.data.tokenizer import train_sentencepiece

    paths = list(args.input) + (stdlib_source_files() if args.stdlib else [])
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        print(f"error: {'no input files' if not paths else 'input not found: ' + missing[0]}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.txt")
        with open(corpus, "w", encoding="utf-8") as f:
            for text in iter_texts(paths):
                f.write(text.rstrip("\n") + "\n")
        model = train_sentencepiece([corpus], args.out, args.vocab_size)
    print(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
