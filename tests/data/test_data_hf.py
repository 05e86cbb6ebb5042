"""Hugging Face tokenizers end to end: a Llama-3-style byte-level BPE (trained here with ``tokenizers``, Llama-3's
special tokens) and a Llama-2-style SentencePiece directory load through megatron-core's HuggingFaceTokenizer with
their own end- and begin-of-text ids; ``tools/preprocess_data.py`` writes exactly their ``encode`` ids plus the
end-of-document id, readable by megatron-core's IndexedDataset; training runs on them, ``model.vocab_size`` follows
the tokenizer; an imported tiny HF Llama trains on its own tokenizer from ``convert_from_hf.py``'s directory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_lc.config import load_config
from megatron_lc.data import DataError, with_tokenizer_vocab
from megatron_lc.data.tokenizer import HuggingFaceTokenizer
from megatron_lc.parallel.topology import Topology
from tests.support.data_util import llama2_tokenizer, llama3_tokenizer, stdlib_texts, write_jsonl

transformers = pytest.importorskip("transformers")

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TEXT = "def f(x):\n    return x * 2  # héllo <|end_of_text|> wörld"
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
         "model.make_vocab_size_divisible_by=64", "data.seq_length=64", "train.micro_batch_size=2",
         "train.global_batch_size=2", "train.train_iters=2", "train.device=cpu", "logging.peak_tflops=1",
         "data.tokenizer_type=HuggingFaceTokenizer"]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    d = tmp_path_factory.mktemp("toks")
    return {"llama3": llama3_tokenizer(d / "llama3"), "llama2": llama2_tokenizer(d / "llama2")}


def preprocess(*args):
    return subprocess.run([sys.executable, "tools/preprocess_data.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)


def test_llama3_tokenizer_has_its_own_special_ids(toks, tmp_path):
    tok = HuggingFaceTokenizer(toks["llama3"])
    hf = transformers.AutoTokenizer.from_pretrained(toks["llama3"])
    assert (tok.vocab_size, tok.eod, tok.bos) == (600, 1, 0)
    assert hf.convert_ids_to_tokens([tok.bos, tok.eod]) == ["<|begin_of_text|>", "<|end_of_text|>"]
    ids = tok.encode(TEXT)
    assert ids == hf.encode(TEXT, add_special_tokens=False) and tok.bos not in ids  # no begin-of-text added
    assert tok.eod in ids and tok.decode(ids) == TEXT.replace("<|end_of_text|>", "")  # a special token in the text
    # a bare tokenizer.json (no tokenizer_config.json beside it): Llama-3's end-of-text recognised by its name
    shutil.copy(os.path.join(toks["llama3"], "tokenizer.json"), tmp_path / "tokenizer.json")
    bare = HuggingFaceTokenizer(str(tmp_path / "tokenizer.json"))
    assert (bare.vocab_size, bare.eod, bare.bos) == (600, 1, 0) and bare.encode(TEXT) == ids


def test_llama2_sentencepiece_directory(toks):
    tok = HuggingFaceTokenizer(toks["llama2"])
    hf = transformers.AutoTokenizer.from_pretrained(toks["llama2"])
    assert (tok.vocab_size, tok.eod, tok.bos) == (500, 3, 2)
    assert hf.convert_ids_to_tokens([tok.bos, tok.eod]) == ["<s>", "</s>"]
    assert tok.encode(TEXT) == hf.encode(TEXT, add_special_tokens=False)


@pytest.mark.parametrize("name,workers", [("llama3", 2), ("llama2", 1)])
def test_preprocess_writes_the_encode_ids_and_the_eod(toks, tmp_path, name, workers):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    texts = stdlib_texts() + ["", "x = 1"]  # an empty document is left out
    write_jsonl(tmp_path / "a.jsonl.gz", texts[:5])
    write_jsonl(tmp_path / "b.jsonl", texts[5:])
    out = preprocess("--input", tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl", "--tokenizer-type",
                     "HuggingFaceTokenizer", "--tokenizer-model", toks[name], "--output-prefix", tmp_path / "c",
                     "--append-eod", "--workers", workers)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    tok = HuggingFaceTokenizer(toks[name])
    want = [tok.encode(t) + [tok.eod] for t in texts if t]
    ds = IndexedDataset(str(tmp_path / "c"))  # megatron-core reads it directly
    assert [ds[i].tolist() for i in range(len(ds))] == want
    assert report["tokens"] == sum(map(len, want)) and report["eod"] == tok.eod and report["workers"] == workers
    assert "tok/s" in out.stderr  # the progress bar's rate is tokens per second
    assert (report["documents"], report["empty_documents"]) == (len(want), 1)
    assert f"left out 1 empty document(s) (no tokens): {len(want)} written" in out.stderr.splitlines()


def test_preprocess_bad_inputs_are_one_line(toks, tmp_path):
    (tmp_path / "empty").mkdir()
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    for args, message in [
        (["--tokenizer-model", tmp_path / "empty"], f"error: {tmp_path / 'empty'}: no tokenizer in this directory"),
        (["--tokenizer-model", toks["llama3"], "--input", tmp_path / "bad.jsonl"],
         f"error: {tmp_path / 'bad.jsonl'}:2: not a JSON object with a 'text' field"),
        (["--tokenizer-model", toks["llama3"], "--input", tmp_path / "none.jsonl"],
         f"error: input not found: {tmp_path / 'none.jsonl'}"),
    ]:
        if "--input" not in args:
            args = args + ["--input", tmp_path / "a.jsonl"]
        out = preprocess(*args, "--output-prefix", tmp_path / "o", "--workers", 2)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1].startswith(message), out.stderr[-500:]


def test_model_vocab_follows_the_tokenizer(toks, caplog):
    base = SMALL + [f"data.tokenizer_model={toks['llama3']}", "data.data_path=x"]
    cfg = with_tokenizer_vocab(load_config(None, base))
    assert (cfg.model.vocab_size, cfg.model.padded_vocab_size) == (600, 640)
    with pytest.raises(DataError, match=r"has 600 tokens, more than model.vocab_size \(512\): unset model.vocab"):
        with_tokenizer_vocab(load_config(None, base + ["model.vocab_size=512"]))
    assert with_tokenizer_vocab(load_config(None, base + ["model.vocab_size=8000"])).model.vocab_size == 8000
    assert "model.vocab_size (8000) is larger than the tokenizer's vocabulary (600): 7400 embedding rows" in caplog.text
    null = with_tokenizer_vocab(load_config(None, ["data.tokenizer_type=NullTokenizer", "data.vocab_size=255"]))
    assert null.model.vocab_size == 256  # ids 0..254 and the end-of-document id 255


def test_training_runs_on_hf_tokenized_data_and_exports_its_tokenizer(toks, tmp_path):
    """Train 2 steps on Llama-3-style data, then tools/convert_to_hf.py: AutoTokenizer loads the export and encodes
    like the run, config.json's bos / eos ids are the tokenizer's; ``--tokenizer`` takes a bare tokenizer.json; a
    ``--tokenizer`` that is no tokenizer is one line and writes nothing."""
    from megatron_lc.training.loop import Trainer

    paragraphs = [p for t in stdlib_texts() for p in t.split("\n\n") if p.strip()]  # short documents
    write_jsonl(tmp_path / "c.jsonl", paragraphs)
    out = preprocess("--input", tmp_path / "c.jsonl", "--tokenizer-model", toks["llama3"], "--output-prefix",
                     tmp_path / "c", "--append-eod")
    assert out.returncode == 0, out.stderr[-2000:]
    cfg = with_tokenizer_vocab(load_config(None, SMALL + [f"data.tokenizer_model={toks['llama3']}",
                                                          f"data.data_path={tmp_path / 'c'}",
                                                          f"checkpoint.save={tmp_path / 'run'}"]))
    trainer = Trainer(cfg, Topology())
    samples = np.stack([trainer.setup.dataset[k] for k in range(32)])
    assert samples.max() < 600 and (samples == 1).sum() > 3  # Llama-3's <|end_of_text|> ends the documents
    losses = trainer.train().losses
    assert len(losses) == 2 and all(np.isfinite(losses)) and abs(losses[0] - np.log(600)) < 0.5

    def export(*extra):
        return subprocess.run([sys.executable, "tools/convert_to_hf.py", tmp_path / "run", *extra], cwd=ROOT,
                              capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)

    assert export(tmp_path / "hf").returncode == 0
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.encode(TEXT, add_special_tokens=False) == HuggingFaceTokenizer(toks["llama3"]).encode(TEXT)
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_cfg["bos_token_id"], hf_cfg["eos_token_id"], hf_cfg["vocab_size"]) == (0, 1, 600)
    assert transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").config.eos_token_id == 1
    (tmp_path / "bare").mkdir()
    shutil.copy(os.path.join(toks["llama3"], "tokenizer.json"), tmp_path / "bare" / "tokenizer.json")
    assert export(tmp_path / "hf2", "--tokenizer", tmp_path / "bare" / "tokenizer.json").returncode == 0
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2").eos_token == "<|end_of_text|>"
    (tmp_path / "notes.txt").write_text("not a tokenizer")
    bad = export(tmp_path / "hf3", "--tokenizer", tmp_path / "notes.txt")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / 'notes.txt'}: not a SentencePiece model")
    assert not (tmp_path / "hf3").exists()


def test_imported_llama_trains_on_its_own_tokenizer(toks, tmp_path):
    """A tiny LlamaForCausalLM saved with the Llama-3-style tokenizer -> convert_from_hf.py -> a run whose tokenizer
    is the import directory: its first loss is the HF model's loss on the same batch (fp32, summation order only:
    1e-5 relative)."""
    from megatron_lc.training.loop import Trainer

    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=600, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      bos_token_id=0, eos_token_id=1)
    hf = transformers.LlamaForCausalLM(hf_cfg).float()
    hf.save_pretrained(tmp_path / "hf")
    transformers.AutoTokenizer.from_pretrained(toks["llama3"]).save_pretrained(tmp_path / "hf")
    out = subprocess.run([sys.executable, "tools/convert_from_hf.py", tmp_path / "hf", tmp_path / "imp"], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    write_jsonl(tmp_path / "c.jsonl", stdlib_texts())
    assert preprocess("--input", tmp_path / "c.jsonl", "--tokenizer-model", tmp_path / "imp", "--output-prefix",
                      tmp_path / "c", "--append-eod").returncode == 0
    import yaml

    from megatron_lc.config import resolve_layout

    # the README's stage-1 config: the import's model section + configs/own_data/llama3_stage1_cpu.yaml
    stage1 = tmp_path / "stage1.yaml"
    stage1.write_text((tmp_path / "imp" / "model.yaml").read_text()
                      + open(os.path.join(ROOT, "configs", "own_data", "llama3_stage1_cpu.yaml")).read())
    readme = with_tokenizer_vocab(load_config(str(stage1), [f"data.tokenizer_model={tmp_path / 'imp'}"]))
    assert readme.model.vocab_size == 600 and readme.data.tokenizer_type == "HuggingFaceTokenizer"
    assert resolve_layout(readme, 2).dp == 2 and readme.train.eval_interval == 10
    model = yaml.safe_load(open(tmp_path / "imp" / "model.yaml"))["model"]
    sets = [f"model.{k}={json.dumps(v)}" for k, v in model.items()]
    cfg = with_tokenizer_vocab(load_config(None, SMALL[5:] + sets + [
        f"data.tokenizer_model={tmp_path / 'imp'}", f"data.data_path={tmp_path / 'c'}",
        f"checkpoint.load={tmp_path / 'imp'}", "checkpoint.finetune=true", "train.lr=0"]))
    trainer = Trainer(cfg, Topology())
    batch = trainer.microbatches(0)[0]
    with torch.no_grad():
        logits = hf(input_ids=batch["tokens"]).logits
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    loss = trainer.train().losses[0]
    assert abs(loss - ref) <= 1e-5 * abs(ref), (loss, ref)
