"""The loop: data parallel, gradient accumulation, ZeRO-1 and resume give the same losses as the plain run.

Tolerance: layouts differ only in the order of fp32 sums (gradients summed over ranks or micro-batches instead of
inside one matmul); after a few AdamW steps on a 2-layer model this moves losses by ~1e-7 relative, far inside the
1e-5 contract. Resume must be *bit-identical* (same ops in the same order, RNG and data position restored)."""
import json
import os

import pytest

from tests.dist_cases import train as dist_cases_train
from tests.support.dist import run_dist
from tests.support.parity import LOSS_RTOL

STEPS = ["train.train_iters=3", "train.global_batch_size=4"]


def assert_losses_close(got, ref):
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= LOSS_RTOL * abs(b), f"step {i + 1}: {a!r} vs {b!r}"


@pytest.fixture(scope="module")
def reference():
    """dp=1, whole global batch in one micro-batch."""
    return run_dist(1, dist_cases_train.train, STEPS + ["train.micro_batch_size=4"])[0][0]


def test_dp2_equals_dp1(reference):
    losses = run_dist(2, dist_cases_train.train, STEPS + ["train.micro_batch_size=2"])
    assert losses[0] == losses[1]
    assert_losses_close(losses[0][0], reference)


def test_gradient_accumulation_equals_one_microbatch(reference):
    (losses, consumed), = run_dist(1, dist_cases_train.train, STEPS + ["train.micro_batch_size=1"])
    assert consumed == 12
    assert_losses_close(losses, reference)


def test_zero1_equals_plain_adamw(reference):
    losses = run_dist(2, dist_cases_train.train, STEPS + ["train.micro_batch_size=2",
                                                          "parallel.use_distributed_optimizer=true"])
    assert_losses_close(losses[0][0], reference)


@pytest.mark.parametrize("world,extra", [(1, []), (2, ["parallel.tensor_model_parallel_size=2"]),
                                         (2, ["parallel.use_distributed_optimizer=true"])])
def test_resume_is_exact(tmp_path, world, extra):
    """6 steps straight == 3 steps + save + resume + 3 steps, loss for loss."""
    common = ["train.global_batch_size=4", "train.micro_batch_size=2" if world == 2 else "train.micro_batch_size=4",
              "train.train_iters=6"] + extra
    straight = run_dist(world, dist_cases_train.train, common)[0][0]
    ck = str(tmp_path / "ck")
    first = run_dist(world, dist_cases_train.train, common + ["train.train_iters=3", f"checkpoint.save={ck}"])[0][0]
    assert os.path.isfile(os.path.join(ck, "iter_0000003", "meta.json"))
    second, consumed = run_dist(world, dist_cases_train.train, common + [f"checkpoint.save={ck}",
                                                                       f"checkpoint.load={ck}"])[0]
    assert consumed == 24
    assert first + second == straight
    with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "6"


def test_checkpoint_of_another_model_is_refused(tmp_path):
    ck = str(tmp_path / "ck")
    run_dist(1, dist_cases_train.train, STEPS + [f"checkpoint.save={ck}"])
    with pytest.raises(AssertionError, match=r"saved for another model: model.hidden_size=64 \(this run: 32\)"):
        run_dist(1, dist_cases_train.train, STEPS + [f"checkpoint.load={ck}", "model.hidden_size=32",
                                                     "model.num_attention_heads=4"])


def test_interrupted_save_keeps_last_good_checkpoint(tmp_path):
    """A half-written iter_N.tmp (a save killed midway) is ignored; resume uses the last complete checkpoint."""
    ck = tmp_path / "ck"
    run_dist(1, dist_cases_train.train, STEPS + [f"checkpoint.save={ck}"])
    broken = ck / "iter_0000004.tmp"
    broken.mkdir()
    (broken / "model_tp00.pt").write_bytes(b"partial")
    (ck / "latest_checkpointed_iteration.txt").write_text("4")
    from megatron_lc.training.checkpointing.directory import find_latest

    assert find_latest(str(ck)) == str(ck / "iter_0000003")
    losses, consumed = run_dist(1, dist_cases_train.train, ["train.train_iters=4", "train.global_batch_size=4",
                                                            f"checkpoint.load={ck}"])[0]
    assert len(losses) == 1 and consumed == 16


def test_metrics_file_written(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    run_dist(1, dist_cases_train.train, STEPS + [f"logging.metrics_file={path}"])
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tokens_per_gpu_per_s", "mfu", "peak_memory_bytes"):
        assert key in recs[0]


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    """With a project configured and the default mode, wandb writes an offline run next to the metrics."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    path = tmp_path / "metrics.jsonl"
    run_dist(1, dist_cases_train.train, ["train.train_iters=2", f"logging.metrics_file={path}",
                                         "logging.wandb_project=megatron_lc_test"])
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(tmp_path.rglob("*"))[:20]


def test_rank_0_shows_a_progress_bar_with_the_time_left_on_a_terminal_only(monkeypatch, caplog):
    """On a terminal rank 0 draws a tqdm bar over the steps (done / total, the time left, the loss) and the step lines
    are written above it (the bar cleared first, not run into); other ranks, and a stderr that is no terminal (a
    log file, a pipe, these tests), get no bar; the step lines are the same either way."""
    import io
    import logging
    import re
    import sys

    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.logger import StepBar
    from megatron_lc.training.loop import Trainer
    from tests.support.parity import small_config

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    caplog.set_level(logging.INFO, logger="megatron_lc")
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    console = logging.StreamHandler(term)  # the console handler of setup_logging, on this terminal
    logging.root.addHandler(console)
    try:
        Trainer(small_config(["train.train_iters=3", "logging.peak_tflops=1", "logging.log_interval=1"]),
                Topology()).train()
    finally:
        logging.root.removeHandler(console)
    text = term.getvalue()
    assert re.search(r"training: +33%\|.*\| 1/3 \[\d\d:\d\d<\d\d:\d\d, .*loss \d+\.\d{4}\]", text), text
    assert re.search(r"training: 100%\|.*\| 3/3 \[\d\d:\d\d<00:00, ", text), text
    assert re.search(r"\rstep +2/3 \| loss ", text) and not re.search(r"\]step ", text), text
    assert [ln.split("|")[0] for ln in caplog.messages if ln.startswith("step")] == [
        "step      1/3 ", "step      2/3 ", "step      3/3 "]
    assert StepBar(1, 3, 0).bar is None  # rank 1
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = StepBar(0, 3, 0)
    assert bar.bar is None and sys.stderr.getvalue() == ""
