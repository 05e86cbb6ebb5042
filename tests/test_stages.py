"""Stages of a run: a checkpoint resumes at another tp (weights and AdamW states resharded), cp or dp; ZeRO-1
shards only at their own layout (else one line, or checkpoint.no_load_optim); checkpoint.finetune restarts the
iteration, data position and schedule; RoPE fields may change between stages (logged), shape fields may not.

Tolerance: the resumed run and the straight one differ only in the reduction order of the tp / cp split (fp32,
~1e-7 relative per op); measured at most 1.3e-7 relative on these losses (tp 2 -> 1), asserted at the 1e-5
contract."""
from __future__ import annotations

import logging

import pytest

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests import dist_cases_train
from tests.dist import run_dist
from tests.parity import small_config

COMMON = ["train.global_batch_size=4", "train.train_iters=6"]


def close(got, ref):
    assert len(got) == len(ref)
    for step, (a, b) in enumerate(zip(got, ref), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a!r} vs straight {b!r}"


@pytest.fixture(scope="module")
def straight():
    """6 steps at tp=1, dp=2."""
    return run_dist(2, dist_cases_train.train, COMMON + ["train.micro_batch_size=2"])[0][0]


@pytest.mark.parametrize("first,second", [
    (["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"], ["train.micro_batch_size=2"]),
    (["train.micro_batch_size=2"], ["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"]),
    (["train.micro_batch_size=2"], ["parallel.context_parallel_size=2", "train.micro_batch_size=4"]),
], ids=["tp2-to-tp1", "tp1-to-tp2", "dp2-to-cp2"])
def test_resume_at_another_layout_continues_the_straight_run(tmp_path, straight, first, second):
    ck = str(tmp_path / "ck")
    a = run_dist(2, dist_cases_train.train, COMMON + first + ["train.train_iters=3", f"checkpoint.save={ck}"])[0][0]
    b = run_dist(2, dist_cases_train.train, COMMON + second + [f"checkpoint.save={ck}", f"checkpoint.load={ck}"])[0][0]
    close(a + b, straight)


def test_zero1_shards_resume_only_at_their_layout(tmp_path):
    ck = str(tmp_path / "ck")
    zero = ["parallel.use_distributed_optimizer=true", "train.micro_batch_size=2"]
    run_dist(2, dist_cases_train.train, COMMON + zero + ["train.train_iters=3", f"checkpoint.save={ck}"])
    with pytest.raises(AssertionError, match=r"holds ZeRO-1 optimizer shards for tp=1, dp\*cp=2; this run has "
                                             r"tp=2, dp\*cp=1 without ZeRO-1 .*no_load_optim starts"):
        run_dist(2, dist_cases_train.train, COMMON + ["parallel.use_distributed_optimizer=true",
                                                      "parallel.tensor_model_parallel_size=2",
                                                      "train.micro_batch_size=4", f"checkpoint.load={ck}"])
    losses, consumed = run_dist(2, dist_cases_train.train, COMMON + [
        "parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4", f"checkpoint.load={ck}",
        "checkpoint.no_load_optim=true"])[0]
    assert len(losses) == 3 and consumed == 24  # weights and data position resumed, AdamW afresh


def test_finetune_restarts_iteration_data_and_schedule(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_lc")
    tiny = ["train.train_iters=3", "train.global_batch_size=2", "train.lr_warmup_iters=2"]
    ck = tmp_path / "stage1"
    Trainer(small_config(tiny + [f"checkpoint.save={ck}"]), Topology()).train()
    t = Trainer(small_config(tiny + [f"checkpoint.load={ck}", "checkpoint.finetune=true", "model.rotary_base=50000",
                                     f"logging.metrics_file={tmp_path}/m.jsonl"]), Topology())
    state = t.train()
    assert state.iteration == 3 and len(state.losses) == 3 and state.consumed_samples == 6
    assert "checkpoint.finetune: iteration 3 -> 0, the data position and the schedule start again" in caplog.text
    assert "continuing with model.rotary_base 10000.0 -> 50000.0" in caplog.text


def test_shape_fields_may_not_change(tmp_path):
    ck = tmp_path / "ck"
    Trainer(small_config(["train.train_iters=1", f"checkpoint.save={ck}"]), Topology()).train()
    with pytest.raises(Exception, match=r"saved for another model: model.num_query_groups=4 \(this run: 2\)"):
        Trainer(small_config(["train.train_iters=2", f"checkpoint.load={ck}", "model.num_query_groups=2"]),
                Topology())
