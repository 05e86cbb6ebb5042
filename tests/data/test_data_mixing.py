"""Long-context mixing (``data.length_mixing``: per-prefix length filter and upsampling of the train split) and
``tools/data_stats.py`` (length histogram, length-weighted mean length)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.config import ConfigError
from megatron_lc.data import DataError, build_dataset
from megatron_lc.data.gpt import mixed_documents, split_documents
from megatron_lc.data.indexed import document_lengths
from tests.dist_cases import data as cases

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    cases.write_corpus(str(d / "web"), 300, seed=5)  # documents of 1-60 tokens, EOD added when read
    cases.write_corpus(str(d / "books"), 300, seed=6, base=100, eod=True)
    return d


def _whole_documents(sample: np.ndarray) -> list[int]:
    """Lengths (without the EOD) of the documents a sample holds whole (between two EODs)."""
    cuts = np.flatnonzero(sample == cases.EOD)
    return [int(b - a - 1) for a, b in zip(cuts[:-1], cuts[1:])]


def test_filter_and_upsampling_of_the_train_split(corpora, tmp_path):
    web, books = str(corpora / "web"), str(corpora / "books")
    sets = [f"data.length_mixing={json.dumps({web: {'min_length': 40}})}", "data.split=90,10,0",
            "train.eval_interval=1", "data.seq_length=256"]
    cfg = cases.config(web, str(tmp_path), sets)
    splits = build_dataset(cfg, [200, 16, 0])
    lengths = document_lengths(web)
    n_train = split_documents(len(lengths), [0.9, 0.1, 0.0])[0]
    doc = splits.train.ds  # megatron-core's GPTDataset of the one prefix
    assert sorted(np.unique(doc.indices).tolist()) == [i for i in range(n_train) if lengths[i] >= 40]
    whole = [n for k in range(len(splits.train)) for n in _whole_documents(splits.train[k])]
    assert whole and min(whole) >= 40  # only documents of at least 40 tokens are read
    valid = [n for k in range(16) for n in _whole_documents(splits.valid[k])]
    assert min(valid) < 40  # the valid split keeps every document
    # upsampling: books' documents of at least 50 stored tokens (EOD included) appear 3 times per epoch
    mixing = {books: {"upsample_length": 50, "upsample_factor": 3}}
    cfg = cases.config(books, str(tmp_path), [f"data.length_mixing={json.dumps(mixing)}", "data.split=1"])
    doc = build_dataset(cfg, [200, 0, 0]).train.ds
    blen = document_lengths(books)
    counts = np.bincount(doc.indices, minlength=len(blen))
    assert (counts == np.where(blen >= 50, 3, 1)).all()
    per_epoch = np.bincount(np.asarray(doc.document_index), minlength=len(blen))
    epochs = len(doc.document_index) // len(doc.indices)
    assert (per_epoch == epochs * counts).all()
    # another rule is another cache entry: the samples change
    plain = build_dataset(cases.config(books, str(tmp_path), ["data.split=1"]), [200, 0, 0]).train
    assert any((plain[k] != build_dataset(cfg, [200, 0, 0]).train[k]).any() for k in range(5))


def test_mixed_documents_rule():
    lengths = np.array([5, 50, 500, 7])
    assert mixed_documents(lengths, np.arange(4), {"min_length": 6}).tolist() == [1, 2, 3]
    assert mixed_documents(lengths, np.arange(4), {"upsample_length": 50, "upsample_factor": 2}).tolist() == [
        0, 1, 1, 2, 2, 3]


def test_mixing_bad_inputs_are_one_line(corpora, tmp_path):
    web = str(corpora / "web")
    for mixing, message in [({"nope": {"min_length": 4}}, "data.length_mixing names 'nope', which is not a prefix"),
                            ({"*": {"min_len": 4}}, "unknown key 'min_len'; valid: min_length, upsample_length"),
                            ({"*": {"upsample_length": 4}}, "upsample_length and upsample_factor go together"),
                            ({"*": {"min_length": 0}}, r"data.length_mixing\['\*'\].min_length \(0\) must be an")]:
        with pytest.raises(ConfigError, match=message):
            cases.config(web, str(tmp_path), [f"data.length_mixing={json.dumps(mixing)}"])
    cfg = cases.config(web, str(tmp_path), ['data.length_mixing={"*": {"min_length": 1000}}'])
    with pytest.raises(DataError, match=r"data.length_mixing leaves no document in the train split of .*web: none "
                                        r"of its 291 has 1000 tokens or more \(the longest has 60\)"):
        build_dataset(cfg, [8, 0, 0])


def test_data_stats_cli(corpora, tmp_path):
    web, books = str(corpora / "web"), str(corpora / "books")
    out = subprocess.run([sys.executable, "tools/data_stats.py", web, books, "--seq-length", "32", "--json",
                          str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    stats = json.loads((tmp_path / "s.json").read_text())
    n = document_lengths(web).astype(np.float64)
    assert stats[web]["stats"]["length_weighted_mean"] == round(float((n * n).sum() / n.sum()), 1)
    assert stats[web]["stats"]["length_weighted_mean_at_seq_length"] == round(
        float((n * np.minimum(n, 32)).sum() / n.sum()), 1)
    assert stats["all"]["stats"]["documents"] == 600 and sum(h["documents"] for h in stats[web]["histogram"]) == 300
    assert f"{web}: 300 documents" in out.stdout and "length-weighted mean (data.mean_document_length)" in out.stdout
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "tools/data_stats.py", str(tmp_path / "none")], cwd=ROOT,
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().startswith(f"error: data file not found: {tmp_path}/none.bin")
