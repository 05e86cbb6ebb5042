"""Tokenize documents into a Megatron ``.bin/.idx`` pair (readable by megatron-core's IndexedDataset).

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer-model data/sp.model --output-prefix data/corpus
    python tools/preprocess_data.py --input a.txt b.txt ...   (each text file is one document)

``.jsonl`` inputs: one document per line, in the ``--json-key`` field (default ``text``)."""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def iter_documents(paths, key: str):
    for p in paths:
        if p.endswith(".jsonl"):
            with open(p, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        yield json.loads(line)[key]
                    except (json.JSONDecodeError, KeyError) as e:
                        raise ValueError(f"{p}:{n}: not a JSON object with a '{key}' field ({e})") from None
        else:
            with open(p, encoding="utf-8", errors="replace") as f:
                yield f.read()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True)
    ap.add_argument("--tokenizer-model", required=True, help="SentencePiece .model")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--json-key", default="text")
    args = ap.parse_args(argv)
    from megatron_lc.data import DataError
    from megatron_lc.data.indexed import write_indexed
    from megatron_lc.data.tokenizer import SentencePieceTokenizer
    from tqdm import tqdm

    missing = [p for p in args.input if not os.path.isfile(p)]
    try:
        if missing:
            raise DataError(f"input not found: {missing[0]}")
        tok = SentencePieceTokenizer(args.tokenizer_model)
        docs = tqdm(iter_documents(args.input, args.json_key), desc="tokenizing", unit="doc", mininterval=1.0)
        n = write_indexed(args.output_prefix, (tok.encode(d) for d in docs))
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {n} tokens to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
