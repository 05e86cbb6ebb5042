"""Per-rank attention work of ring attention's zigzag layout when packed documents do not attend to each other
(``data.reset_attention_mask``), on the demo corpus: how far from balanced the cp ranks are.

    python bench/document_balance.py [--seq 16384 65536] [--cp 2 4 8] [--samples 64]   # JSON on stdout

Without masks the zigzag layout gives every ring rank the same causal work (chunks r and 2R-1-r). With masks a
query sees only the earlier tokens of its own document, so a rank whose chunks fall in short documents does less.
Counted per sample (b = 1: every layer waits for the slowest rank), two ways:

* ``visible``: the (query, key) pairs the masks let through -- the work of an ideal varlen kernel;
* ``blocks``: the pairs of the blocks ``attention/ring.py`` computes -- a block of one ring step is computed whole
  (dense, masked) when any of its queries shares a document with its keys, and skipped otherwise.

For each, ``max/mean`` over ranks (1.0 = balanced), its mean and worst over samples, and the fraction of the
causal work that is left. Ulysses and FPDT split heads, not tokens: every rank attends the whole sequence for its
heads, balanced whatever the documents. Also printed: the corpus' length-weighted mean document length, the value
of ``data.mean_document_length`` for the estimator. The demo corpus (Python stdlib sources, SentencePiece 8000) is
built under data/demo/ when missing (a few minutes), or pass ``--data-path`` and ``--eod``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def documents_of(tokens: np.ndarray, eod: int) -> np.ndarray:
    """Document index of every token (the EOD belongs to the document it ends), as ``data/dataset.py`` does."""
    is_eod = (tokens == eod).astype(np.int64)
    return np.cumsum(is_eod) - is_eod


def visible_per_token(doc: np.ndarray) -> np.ndarray:
    """Keys each query sees: its position in its document + 1."""
    pos = np.arange(len(doc))
    starts = np.concatenate([[0], np.flatnonzero(np.diff(doc)) + 1])
    return pos - starts[doc - doc[0]] + 1


def zigzag_chunks(s: int, R: int, r: int) -> tuple[slice, slice]:
    c = s // (2 * R)
    return slice(r * c, (r + 1) * c), slice((2 * R - 1 - r) * c, (2 * R - r) * c)


def ring_work(doc: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """(visible pairs, computed block pairs) of every ring rank for one sample (see module doc)."""
    s = len(doc)
    c = s // (2 * R)
    vis = visible_per_token(doc)
    visible, blocks = np.zeros(R), np.zeros(R)

    def overlap(a: slice, b: slice) -> bool:
        return doc[a].min() <= doc[b].max() and doc[b].min() <= doc[a].max()

    for r in range(R):
        f, b = zigzag_chunks(s, R, r)
        visible[r] = vis[f].sum() + vis[b].sum()
        work = (2 * c) * (2 * c + 1) / 2  # step 0: own chunks, causal on the local order
        for j in range(R):
            if j == r:
                continue
            fj, bj = zigzag_chunks(s, R, j)
            if j < r:  # all queries x j's front keys
                if overlap(f, fj) or overlap(b, fj):
                    work += 2 * c * c
            elif overlap(b, fj) or overlap(b, bj):  # back queries x all of j's keys
                work += c * 2 * c
        blocks[r] = work
    return visible, blocks


def summarize(ratios: list, left: list) -> dict:
    return {"max_over_mean_mean": round(float(np.mean(ratios)), 4), "max_over_mean_worst": round(float(max(ratios)), 4),
            "work_left_of_causal": round(float(np.mean(left)), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--data-path", default=None, help=".bin/.idx prefix (default: the demo corpus)")
    ap.add_argument("--eod", type=int, default=None, help="end-of-document id (default: the demo tokenizer's)")
    args = ap.parse_args()

    from megatron_lc.config import load_config
    from megatron_lc.data import build_dataset
    from megatron_lc.data.indexed import open_indexed

    data_path, eod = args.data_path, args.eod
    if data_path is None:
        from megatron_lc.config.data import demo_files
        from megatron_lc.data.demo import prepare_demo_data
        from megatron_lc.data.tokenizer import SentencePieceTokenizer

        data_path, tok_model = demo_files(8000)
        prepare_demo_data(data_path, tok_model, 8000)
        eod = SentencePieceTokenizer(tok_model).eod
        tok = [f"data.tokenizer_model={tok_model}", "model.vocab_size=8000"]
    elif eod is None:
        sys.exit("--eod is required with --data-path")
    else:  # the files' ids are below the end-of-document id (NullTokenizer's rule)
        tok = ["data.tokenizer_type=NullTokenizer", f"data.vocab_size={eod}"]
    indexed = open_indexed(data_path)
    lengths = np.asarray(indexed.sequence_lengths, dtype=np.float64) + 1  # + EOD
    out = {"data_path": data_path, "documents": len(lengths),
           "mean_document_length": round(float(lengths.mean()), 1),
           "length_weighted_mean_document_length": round(float((lengths ** 2).sum() / lengths.sum()), 1),
           "rows": []}
    for s in args.seq:  # the training split's first samples (megatron-core's GPTDataset, data/gpt.py)
        cfg = load_config(None, tok + [f"data.data_path={data_path}", f"data.seq_length={s}", "train.seed=1234"])
        ds = build_dataset(cfg, [args.samples, 0, 0]).train
        docs = [documents_of(ds[k][:-1], eod) for k in range(args.samples)]
        causal = s * (s + 1) / 2
        for R in args.cp:
            if s % (2 * R):
                continue
            vr, br, vl, bl = [], [], [], []
            for doc in docs:
                visible, blocks = ring_work(doc, R)
                vr.append(visible.max() / visible.mean())
                br.append(blocks.max() / blocks.mean())
                vl.append(visible.sum() / causal)
                bl.append(blocks.sum() / causal)
            out["rows"].append({"seq": s, "cp": R, "samples": len(docs),
                                "documents_per_sample": round(float(np.mean([d[-1] - d[0] + 1 for d in docs])), 2),
                                "visible": summarize(vr, vl), "blocks": summarize(br, bl)})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
