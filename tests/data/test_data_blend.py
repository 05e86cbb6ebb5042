"""megatron-core's blended datasets with splits (``data.data_path`` as a blend, ``data.split``): the blend's shares,
the same global batches whatever the layout (dp, ring / Ulysses / FPDT cp, tp: every rank's shards put back together
are the one-process batch, packed-document fields included), a run resumed at another layout reads the samples of
the uninterrupted run, and the bad inputs are one line."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from megatron_lc.config import ConfigError, load_config
from megatron_lc.data import DataError, build_dataset, split_sizes
from tests.dist_cases import data as cases
from tests.support.dist import run_dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    cases.write_corpus(str(d / "web"), 400, seed=1, base=0)  # ids 0..99, EOD added when read
    cases.write_corpus(str(d / "code"), 400, seed=2, base=100, eod=True)  # ids 100..199, EOD in the files
    return d


def test_blend_shares_follow_the_weights(corpora, tmp_path):
    """0.7 / 0.3 over 1000 samples: each source's share within 2% of its weight (BlendedDataset's greedy rule keeps
    it within one sample), and the tokens of a sample come from its source only."""
    cfg = cases.config(f"[0.7,{corpora / 'web'},0.3,{corpora / 'code'}]", str(tmp_path), ["train.train_iters=250"])
    train = build_dataset(cfg, split_sizes(cfg, 4)).train
    assert len(train) == 1000
    src = np.array([train.source(k) for k in range(1000)])
    assert abs((src == 0).mean() - 0.7) <= 0.02 and abs((src == 1).mean() - 0.3) <= 0.02
    for k in range(0, 1000, 37):
        ids = train[k][train[k] != cases.EOD]
        assert ((ids < 100) if src[k] == 0 else (ids >= 100)).all(), k
    # unweighted list: weighted by the prefixes' token counts
    both = build_dataset(cases.config(f"[{corpora / 'web'},{corpora / 'code'}]", str(tmp_path)), [1000, 0, 0]).train
    share = np.mean([both.source(k) == 0 for k in range(1000)])
    assert 0.3 < share < 0.7


LAYOUTS = [["parallel.context_parallel_size=1"],  # dp = 2
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"],
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"],
           ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8"],
           ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]]


def test_same_global_batches_at_every_layout(corpora, tmp_path):
    """The first 20 global batches (4 samples of 32 tokens, a blend, document fields on) at dp=2, ring / Ulysses /
    FPDT cp=2 and tp=2 (SP): every rank's micro-batches, cp shards gathered back, are the one-process batch's rows
    -- tokens, labels, positions, loss mask and document ids. The index cache is built by rank 0 of the first
    layout; every later build reads it."""
    blend = f"[0.7,{corpora / 'web'},0.3,{corpora / 'code'}]"
    cache = str(tmp_path / "cache")
    per_rank = run_dist(2, cases.read_batches, blend, cache, LAYOUTS, 20)
    ref = cases.reference_batches(blend, cache, 20)
    for li, layout in enumerate(LAYOUTS):
        for step in range(20):
            got = {}
            for rank in per_rank:
                for sid, row in rank[li][step].items():
                    if sid in got:  # tp / cp replicas of a dp rank read the same sample
                        assert all((got[sid][k] == row[k]).all() for k in cases.FIELDS), (layout, step, sid)
                    got[sid] = row
            assert sorted(got) == sorted(ref[step]) == list(range(4 * step, 4 * step + 4)), (layout, step)
            for sid, row in ref[step].items():
                for k in cases.FIELDS:
                    assert np.array_equal(got[sid][k], row[k]), (layout, step, sid, k)
    assert any((row["tokens"] == cases.EOD).any() for rows in ref for row in rows.values())  # documents are packed


def test_resume_at_another_layout_reads_the_uninterrupted_samples(corpora, tmp_path):
    """6 steps in one process vs 3 steps at dp=2 (saved) + 3 steps resumed at ring cp=2: the same tokens, step by
    step (both runs stay within one epoch of the blend, so the samples do not depend on the run length)."""
    blend = f"[0.7,{corpora / 'web'},0.3,{corpora / 'code'}]"
    cache, ck = str(tmp_path / "cache"), str(tmp_path / "ck")
    (whole, consumed), = [cases.record_full_batches(0, 1, blend, cache, ["train.train_iters=6"])]
    first = run_dist(2, cases.record_full_batches, blend, cache, ["train.train_iters=3", f"checkpoint.save={ck}"])
    second = run_dist(2, cases.record_full_batches, blend, cache,
                      ["train.train_iters=6", f"checkpoint.save={ck}", f"checkpoint.load={ck}",
                       "parallel.context_parallel_size=2"])
    assert consumed == 24 and second[0][1] == 24
    steps = [{**a, **b} for a, b in zip(first[0][0], first[1][0])] + [{**a, **b} for a, b in zip(second[0][0],
                                                                                                    second[1][0])]
    assert len(steps) == 6
    for t in range(6):
        assert sorted(steps[t]) == sorted(whole[t]), t
        for sid in whole[t]:
            assert np.array_equal(steps[t][sid], whole[t][sid]), (t, sid)


# ---- bad input, one line each ------------------------------------------------------------------------------------
@pytest.mark.parametrize("data_path,message", [
    ("[0.7,a,x,b]", "data.data_path: weight 'x' (item 3) does not parse as a number"),
    ("[0,a,0,b]", "data.data_path: the weights [0.0, 0.0] sum to zero"),
    ("[0.7,a,b]", "looks like a weight, but the list is not [weight, prefix, weight, prefix, ...]"),
])
def test_bad_blend_is_a_config_error(data_path, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"data.data_path={data_path}"])
    assert message in str(e.value)


def test_bad_split_is_a_config_error():
    for split, message in [("9,1,x", "data.split '9,1,x' does not parse"), ("1,2,3,4", "does not parse"),
                           ("0,0,0", "the parts sum to zero")]:
        with pytest.raises(ConfigError, match=message):
            load_config(None, [f"data.split={split}"])


def test_missing_prefix_and_empty_splits_are_data_errors(corpora, tmp_path):
    cfg = cases.config(f"[0.5,{corpora / 'web'},0.5,{tmp_path / 'none'}]", str(tmp_path))
    with pytest.raises(DataError, match=f"data file not found: {tmp_path / 'none'}.bin"):
        build_dataset(cfg, [4, 0, 0])
    cfg = cases.config(str(corpora / "web"), str(tmp_path), ["data.split=1,0,0", "train.eval_interval=2"])
    with pytest.raises(DataError, match=r"the valid split is empty: data.split '1,0,0' gives it no documents"):
        build_dataset(cfg, split_sizes(cfg, 4))
    cfg = cases.config(str(corpora / "web"), str(tmp_path), ["data.split=999,1,0", "train.eval_interval=2"])
    with pytest.raises(DataError, match=r"the valid split of .*web is empty: data.split '999,1,0' gives none of its "
                                        r"400 documents to valid"):
        build_dataset(cfg, split_sizes(cfg, 4))


def test_blend_errors_under_the_launcher_are_one_line(corpora, tmp_path):
    cmd = [sys.executable, "pretrain_gpt.py", "--nproc-per-node", "2", "--config", "configs/tiny_cpu.yaml",
           "--set", "data.prepare_demo_data=false", "--set", "data.tokenizer_type=NullTokenizer",
           "--set", "data.vocab_size=255", "--set", "model.vocab_size=", "--set", "checkpoint.save=", "--set",
           f"data.data_path=[0.5,{corpora / 'web'},0.5,{tmp_path / 'none'}]"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    # rank 0 speaks for all; the other rank's copy shows only when the launcher stops it late (pretrain_gpt.py)
    errors = {ln.replace("[rank 1] ", "") for ln in out.stderr.splitlines() if "error:" in ln}
    assert errors == {f"error: data file not found: {tmp_path / 'none'}.bin (data.data_path is the prefix of a "
                      f".bin/.idx pair; make one with tools/preprocess_data.py)"}, out.stderr[-2000:]
