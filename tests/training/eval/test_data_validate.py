"""Validation during training (``train.eval_interval``, ``eval_iters``, ``test_at_end``; training/eval/validation.py):
the
valid loss at the interval and at the end, the test split on request, in metrics.jsonl, on the console and in
plot_metrics' picture; equal to a plain one-process evaluation of the same samples; the same under tp, ring /
Ulysses / FPDT cp, FSDP2, MsT and Memo; an empty valid split is one line."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from megatron_lc.data.dataset import make_batch
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import data as cases
from tests.support.dist import run_dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot_metrics  # noqa: E402

# Tolerance: the layouts change only how sums are split and ordered (fp32 on CPU, ~1e-7 relative per reduction);
# the contract is 1e-5 relative on a loss.
RTOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("valid")
    cases.write_corpus(str(d / "web"), 600, seed=3)
    cases.write_corpus(str(d / "code"), 600, seed=4, base=100, eod=True)
    return f"[0.6,{d / 'web'},0.4,{d / 'code'}]", d


def test_validation_at_the_interval_and_the_end(corpus, tmp_path, caplog):
    """eval_interval 2 over 5 steps: valid after steps 2, 4 and 5 (the end), test after 5; the last valid loss is
    the plain model's mean token loss over the first eval_iters x gbs valid samples, computed here directly."""
    caplog.set_level(logging.INFO, logger="megatron_lc")
    blend, d = corpus
    mfile = tmp_path / "metrics.jsonl"
    cfg = cases.config(blend, str(d / "cache"), ["train.train_iters=5", "train.eval_interval=2", "train.eval_iters=2",
                                                 "train.test_at_end=true", "data.split=90,5,5",
                                                 f"logging.metrics_file={mfile}"])
    trainer = Trainer(cfg, Topology())
    trainer.train()
    recs = [json.loads(line) for line in mfile.read_text().splitlines()]
    evals = [(r["eval"], r["step"]) for r in recs if "eval" in r]
    assert evals == [("valid", 2), ("valid", 4), ("valid", 5), ("test", 5)]
    assert [r["step"] for r in recs if "eval" not in r] == [1, 2, 3, 4, 5]
    last = [r for r in recs if r.get("eval") == "valid"][-1]
    assert last["samples"] == 8 and last["perplexity"] == pytest.approx(math.exp(last["loss"]))
    # the plain model, the same samples: sum of masked token losses / tokens
    valid = trainer.setup.splits.valid
    batch = make_batch(valid, list(range(8)), cfg.data)
    with torch.no_grad():
        loss = trainer.model(batch["tokens"], batch["position_ids"], batch["labels"], batch.get("documents"))
    ref = float((loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum())
    assert abs(last["loss"] - ref) <= RTOL * ref and last["tokens"] == int(batch["loss_mask"].sum())
    test = [r for r in recs if r.get("eval") == "test"][0]
    assert test["loss"] != last["loss"]  # another split
    assert "valid at step 4 | valid loss" in caplog.text and "test at step 5 | test loss" in caplog.text
    assert plot_metrics.read_evals(str(mfile))["valid"][-1]["step"] == 5
    assert plot_metrics.main([str(mfile), "-o", str(tmp_path / "m.png")]) == 0


LAYOUTS = [[],  # dp = 2
           ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"],
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"],
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"],
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8"],
           ["parallel.use_torch_fsdp2=true"],
           ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=3"],
           ["parallel.context_parallel_size=2", "memory.activation_offload=memo", "memory.offload_fraction=0.5"]]


def test_valid_loss_is_the_same_at_every_layout(corpus):
    """The freshly built model (the same weights at any layout) evaluated under each layout on 2 ranks: the valid
    loss of one process within 1e-5 relative, the same token count."""
    blend, d = corpus
    cache = str(d / "cache")
    ref_loss, ref_tokens = cases.valid_losses(0, 1, blend, cache, [[]])[0]
    got = run_dist(2, cases.valid_losses, blend, cache, LAYOUTS)
    for rank in got:
        for layout, (loss, tokens) in zip(LAYOUTS, rank):
            assert tokens == ref_tokens, layout
            assert abs(loss - ref_loss) <= RTOL * ref_loss, (layout, loss, ref_loss)


def test_empty_valid_split_is_one_line(corpus, tmp_path):
    blend, d = corpus
    cmd = [sys.executable, "pretrain_gpt.py", "--config", "configs/tiny_cpu.yaml", "--set", "data.prepare_demo_data=false",
           "--set", "data.tokenizer_type=NullTokenizer", "--set", "data.vocab_size=255", "--set", "model.vocab_size=",
           "--set", f"data.data_path={blend}", "--set", "data.split=1,0,0", "--set", "train.eval_interval=10",
           "--set", f"data.data_cache_path={tmp_path}", "--set", "checkpoint.save="]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert [ln for ln in out.stderr.splitlines() if "error:" in ln] == [
        "error: the valid split is empty: data.split '1,0,0' gives it no documents"]
