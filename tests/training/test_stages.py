"""Stages of a run: a checkpoint (torch.distributed.checkpoint) resumes at another tp, cp or dp, with or without
ZeRO-1, weights and AdamW states resharded; a format-2 checkpoint (torch files per tp rank) still loads;
checkpoint.finetune restarts the iteration, data position and schedule; RoPE fields may change between stages
(logged), shape fields may not.

Tolerance: the resumed run and the straight one differ only in the reduction order of the tp / cp split (fp32,
~1e-7 relative per op); measured at most 1.3e-7 relative on these losses (tp 2 -> 1), asserted at the 1e-5
contract."""
from __future__ import annotations

import logging

import pytest
import torch

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import train as dist_cases_train
from tests.support.dist import run_dist
from tests.support.parity import small_config

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
    (["parallel.use_torch_fsdp2=true", "train.micro_batch_size=2"],
     ["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"]),
    (["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"],
     ["parallel.use_torch_fsdp2=true", "parallel.context_parallel_size=2", "train.micro_batch_size=4"]),
], ids=["tp2-to-tp1", "tp1-to-tp2", "dp2-to-cp2", "fsdp-dp2-to-tp2", "tp2-to-fsdp-cp2"])
def test_resume_at_another_layout_continues_the_straight_run(tmp_path, straight, first, second):
    ck = str(tmp_path / "ck")
    a = run_dist(2, dist_cases_train.train, COMMON + first + ["train.train_iters=3", f"checkpoint.save={ck}"])[0][0]
    b = run_dist(2, dist_cases_train.train, COMMON + second + [f"checkpoint.save={ck}", f"checkpoint.load={ck}"])[0][0]
    close(a + b, straight)


@pytest.mark.parametrize("first,second", [
    (["parallel.use_distributed_optimizer=true", "train.micro_batch_size=2"],
     ["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"]),
    (["train.micro_batch_size=2"],
     ["parallel.context_parallel_size=2", "train.micro_batch_size=4", "parallel.use_distributed_optimizer=true"]),
], ids=["zero1-dp2-to-tp2", "dp2-to-zero1-cp2"])
def test_zero1_states_move_to_another_layout(tmp_path, straight, first, second):
    """ZeRO-1 shards AdamW states by parameter over dp x cp; saved by parameter name, they load into another
    partition (or into plain AdamW) and the run continues as the straight one."""
    ck = str(tmp_path / "ck")
    a = run_dist(2, dist_cases_train.train, COMMON + first + ["train.train_iters=3", f"checkpoint.save={ck}"])[0][0]
    b = run_dist(2, dist_cases_train.train, COMMON + second + [f"checkpoint.save={ck}", f"checkpoint.load={ck}"])[0][0]
    close(a + b, straight)


def test_format2_checkpoint_still_loads(tmp_path):
    """A checkpoint of the previous format (one torch file per tp rank, here tp=2) loads at tp=1: same weights."""
    cfg = small_config(["train.train_iters=1"])
    model = Trainer(cfg, Topology()).model
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    ck = tmp_path / "old"
    dist_cases_train.write_format2(ck / "iter_0000001", cfg, full, tp=2)
    t = Trainer(small_config(["train.train_iters=2", f"checkpoint.load={ck}", "train.seed=7"]), Topology())
    for n, p in t.model.named_parameters():
        assert torch.equal(p.detach(), full[n]), n


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
