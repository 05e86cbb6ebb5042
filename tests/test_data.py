"""Data: tokenizer -> preprocess -> .bin/.idx (megatron-core format) -> packed samples, and clear errors for bad files."""
import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.data import DataError
from megatron_lc.data.dataset import MockDataset, PackedDataset, make_batch
from megatron_lc.data.indexed import open_indexed, write_indexed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def test_packed_samples_cover_the_stream_in_seeded_order(corpus):
    d, tok, docs, _ = corpus
    seq = 64
    pk = PackedDataset(open_indexed(str(d / "docs")), seq, seed=7, eod=tok.eod)
    order, ends, sample_order = pk._epoch(0)
    stream = np.concatenate([np.array(docs[i] + [tok.eod]) for i in order])
    assert ends[-1] == len(stream)
    for k in range(pk.samples_per_epoch):
        start = int(sample_order[k]) * seq
        assert pk[k].tolist() == stream[start:start + seq + 1].tolist()
    # every sample of the epoch is used once; the next epoch reshuffles
    assert sorted(sample_order.tolist()) == list(range(pk.samples_per_epoch))
    assert pk[pk.samples_per_epoch].shape == (seq + 1,)
    same = PackedDataset(open_indexed(str(d / "docs")), seq, seed=7, eod=tok.eod)
    assert all((same[k] == pk[k]).all() for k in range(5))


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
