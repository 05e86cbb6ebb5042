"""Data: tokenizer -> preprocess -> .bin/.idx (megatron-core format) -> packed samples, and clear errors for bad files."""
import os
import subprocess
import sys

import pytest

from megatron_lc.config import load_config
from megatron_lc.data import DataError, build_dataset
from megatron_lc.data.dataset import MockDataset, make_batch
from megatron_lc.data.indexed import open_indexed, write_indexed

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PY = sys.executable


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small SentencePiece model and three documents, preprocessed with the CLI tools."""
    d = tmp_path_factory.mktemp("data")
    import sysconfig

    files = [os.path.join(sysconfig.get_paths()["stdlib"], n) for n in ("abc.py", "bisect.py", "colorsys.py")]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([PY, "tools/train_tokenizer.py", "--input", *files, "--vocab-size", "400", "--out",
                    str(d / "sp")], cwd=ROOT, env=env, check=True, capture_output=True)
    out = subprocess.run([PY, "tools/preprocess_data.py", "--input", *files, "--tokenizer-model", str(d / "sp.model"),
                          "--output-prefix", str(d / "docs")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    from megatron_lc.data.tokenizer import SentencePieceTokenizer

    tok = SentencePieceTokenizer(str(d / "sp.model"))
    docs = [tok.encode(open(f, encoding="utf-8").read()) for f in files]
    return d, tok, docs, files


def test_round_trip_gives_back_the_tokens(corpus):
    d, tok, docs, files = corpus
    ds = open_indexed(str(d / "docs"))
    assert len(ds) == 3
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc
    assert tok.decode(ds[1]).strip() == open(files[1], encoding="utf-8").read().strip()


def _pieces(sample, eod):
    """A sample cut at its end-of-document ids: [(tokens, ended by eod), ...]."""
    out, cur = [], []
    for t in sample.tolist():
        if t == eod:
            out.append((cur, True))
            cur = []
        else:
            cur.append(t)
    return out + [(cur, False)]


def test_samples_are_windows_of_eod_separated_documents_in_seeded_order(corpus, tmp_path):
    """megatron-core's GPTDataset over files written without end-of-document ids (EodDocuments adds them): every
    whole document between two eods in a sample is one of the files' documents, the first piece ends one and the
    last begins one; the same seed gives the same samples, another seed others."""
    d, tok, docs, _ = corpus
    cfg = load_config(None, [f"data.data_path={d / 'docs'}", f"data.tokenizer_model={d / 'sp.model'}",
                             "data.seq_length=64", "data.split=1", f"data.data_cache_path={tmp_path}",
                             "model.vocab_size=400", "train.train_iters=20"])
    ds = build_dataset(cfg, [40, 0, 0]).train
    assert len(ds) >= 40 and ds.eod == tok.eod == 3  # one whole epoch is built
    joined = ["|" + " ".join(map(str, doc)) + "|" for doc in docs]
    eods = 0
    for k in range(len(ds)):
        sample = ds[k]
        assert sample.shape == (65,)
        pieces = _pieces(sample, tok.eod)
        eods += len(pieces) - 1
        for i, (piece, ended) in enumerate(pieces):
            text = " ".join(map(str, piece))
            if i > 0 and ended:  # a whole document
                assert any(j == "|" + text + "|" for j in joined), (k, i)
            elif ended and piece:  # the end of one
                assert any(j.endswith(" " + text + "|") or j == "|" + text + "|" for j in joined), (k, i)
            elif i > 0 and piece:  # the beginning of one
                assert any(j.startswith("|" + text + " ") or j.startswith("|" + text + "|") for j in joined), (k, i)
    assert eods >= 2  # 3 documents, each ended once in the epoch (the last may fall in the dropped tail)
    again = build_dataset(cfg, [40, 0, 0]).train
    assert all((again[k] == ds[k]).all() for k in range(40))
    other = build_dataset(load_config(None, [f"{k}={v}" for k, v in [("data.data_path", d / "docs"),
                          ("data.tokenizer_model", d / "sp.model"), ("data.seq_length", 64), ("data.split", 1),
                          ("data.data_cache_path", tmp_path), ("model.vocab_size", 400), ("train.seed", 7)]]),
                          [40, 0, 0]).train
    assert not all((other[k] == ds[k]).all() for k in range(40))


def test_batch_shapes_and_shift():
    ds = MockDataset(16, 100, seed=1)
    b = make_batch(ds, [3, 4])
    assert b["tokens"].shape == (2, 16) and (b["labels"][:, :-1] == b["tokens"][:, 1:]).all()
    assert b["position_ids"][1].tolist() == list(range(16)) and b["sample_ids"].tolist() == [3, 4]


def test_missing_truncated_and_wrong_header(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*nope.bin"):
        open_indexed(str(tmp_path / "nope"))
    write_indexed(str(tmp_path / "x"), [[1, 2, 3], [4, 5]])
    open_indexed(str(tmp_path / "x"))
    with open(tmp_path / "x.bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(DataError, match=r"x.bin: size 8 bytes does not match its index \(20 bytes expected\)"):
        open_indexed(str(tmp_path / "x"))
    write_indexed(str(tmp_path / "y"), [[1, 2, 3]])
    (tmp_path / "y.idx").write_bytes(b"GARBAGE!!" + b"\0" * 40)
    with pytest.raises(DataError, match="y.idx: wrong header"):
        open_indexed(str(tmp_path / "y"))


def test_tokenizer_errors(tmp_path):
    from megatron_lc.data.tokenizer import SentencePieceTokenizer

    with pytest.raises(DataError, match="tokenizer model not found"):
        SentencePieceTokenizer(str(tmp_path / "none.model"))
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match="not a SentencePiece model"):
        SentencePieceTokenizer(str(tmp_path / "bad.model"))


def test_the_demo_data_ends_every_document_with_eod_and_reads_without_a_notice(tmp_path, monkeypatch, caplog):
    """``prepare_demo_data`` writes the end-of-document id after each document (an empty one left out), so training
    on it adds none and says nothing; a pair an earlier version wrote without them is written again."""
    import logging
    import sysconfig

    from megatron_lc.data import demo
    from megatron_lc.data.tokenizer import SentencePieceTokenizer

    stdlib = sysconfig.get_paths()["stdlib"]
    (tmp_path / "empty.py").write_text("")
    files = [os.path.join(stdlib, n) for n in ("abc.py", "bisect.py", "colorsys.py")] + [str(tmp_path / "empty.py")]
    monkeypatch.setattr(demo, "stdlib_source_files", lambda: files)
    prefix, model = str(tmp_path / "demo" / "sp400"), str(tmp_path / "demo" / "sp400.model")
    caplog.set_level(logging.INFO)
    demo.prepare_demo_data(prefix, model, 400)
    tok = SentencePieceTokenizer(model)
    docs = [tok.encode(open(f, encoding="utf-8").read()) for f in files[:3]]
    ds = open_indexed(prefix)
    assert len(ds) == 3 and [ds[i].tolist() for i in range(3)] == [doc + [tok.eod] for doc in docs]
    assert "in 3 documents" in caplog.text
    cfg = load_config(None, [f"data.data_path={prefix}", f"data.tokenizer_model={model}", "data.seq_length=64",
                             "data.split=1", f"data.data_cache_path={tmp_path / 'cache'}", "model.vocab_size=400"])
    caplog.clear()
    build_dataset(cfg, [10, 0, 0])
    assert "end without the end-of-document id" not in caplog.text
    write_indexed(prefix, docs)  # as an earlier version wrote the demo's pair
    demo.prepare_demo_data(prefix, model, 400)
    assert "written without end-of-document ids" in caplog.text
    ds = open_indexed(prefix)
    assert [ds[i].tolist() for i in range(3)] == [doc + [tok.eod] for doc in docs]
    caplog.clear()
    write_indexed(prefix + "_user", docs)  # a user's pair without them is still told of it
    build_dataset(load_config(None, [f"data.data_path={prefix}_user", f"data.tokenizer_model={model}",
                                     "data.seq_length=64", "data.split=1", f"data.data_cache_path={tmp_path / 'cache'}",
                                     "model.vocab_size=400"]), [10, 0, 0])
    assert "3 of 3 documents end without the end-of-document id" in caplog.text
