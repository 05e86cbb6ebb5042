"""Non-finite loss / grad norm: the step is skipped by every rank and reported; N in a row stop training.
The NaN is injected by monkeypatching in the test (the library has no injection switch)."""
import json
import math
import os

import pytest
import torch

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.errors import NonFiniteError
from megatron_lc.training.loop import Trainer
from tests.dist_cases import faults as dist_cases_faults
from tests.support.dist import run_dist
from tests.support.parity import small_config


def _inject(monkeypatch, bad_steps, where):
    """Make the loss (``where='loss'``) or one gradient element (``'grad'``) NaN at the given 1-based steps."""
    original = Trainer.forward_backward

    def forward_backward(self, batches):
        loss = original(self, batches)
        if self.state.iteration + 1 in bad_steps:
            if where == "loss":
                return math.nan
            next(self.model.parameters()).grad.view(-1)[0] = math.inf
        return loss

    monkeypatch.setattr(Trainer, "forward_backward", forward_backward)


def _params(model):
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_skipped_steps_leave_weights_unchanged_and_training_goes_on(tmp_path, monkeypatch):
    _inject(monkeypatch, {3, 4}, "grad")
    metrics = tmp_path / "m.jsonl"
    cfg = small_config(["train.train_iters=6", "train.max_consecutive_skipped_steps=3",
                        f"logging.metrics_file={metrics}"])
    trainer = Trainer(cfg, Topology())
    snapshots = []
    original = trainer.train_step
    monkeypatch.setattr(trainer, "train_step", lambda i: (original(i), snapshots.append(_params(trainer.model)))[0])
    state = trainer.train()
    assert state.iteration == 6 and state.skipped_steps == 2
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, False, True, True, False, False]
    assert not math.isfinite(recs[2]["grad_norm"])
    # skipped steps: no optimizer update at all (bit-identical weights), later steps update again
    assert torch.equal(snapshots[1], snapshots[2]) and torch.equal(snapshots[2], snapshots[3])
    assert not torch.equal(snapshots[3], snapshots[4])
    adam_steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert adam_steps == {4}  # 6 steps, 2 skipped


def test_non_finite_steps_in_a_row_stop_with_a_clear_error(tmp_path, monkeypatch):
    _inject(monkeypatch, set(range(2, 100)), "loss")
    metrics = tmp_path / "m.jsonl"
    cfg = small_config(["train.train_iters=10", "train.max_consecutive_skipped_steps=3",
                        f"logging.metrics_file={metrics}"])
    with pytest.raises(NonFiniteError, match=r"^3 steps in a row \(up to step 4\) had a non-finite loss or grad "
                                             r"norm; stopping \(train.max_consecutive_skipped_steps=3\)"):
        Trainer(cfg, Topology()).train()
    recs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["skipped"] for r in recs] == [False, True, True, True]


def test_one_rank_non_finite_makes_every_rank_skip(tmp_path):
    """Only rank 1 sees a NaN grad norm at step 2: both ranks skip it (without the agreement rank 0 would step and
    the dp replicas would differ from then on), then 3 bad steps in a row on rank 1 stop both ranks together."""
    common = ["train.train_iters=4", "train.global_batch_size=4", "train.max_consecutive_skipped_steps=2"]
    (s0, p0, e0), (s1, p1, e1) = run_dist(2, dist_cases_faults.nonfinite_on_one_rank, common, {2}, 1)
    assert s0 == s1 == [False, True, False, False]
    assert e0 is None and e1 is None
    assert torch.equal(p0, p1)
    (s0, p0, e0), (s1, p1, e1) = run_dist(2, dist_cases_faults.nonfinite_on_one_rank, common, {2, 3, 4}, 1)
    assert s0 == s1 == [False, True, True]
    assert e0 == e1 and e0.startswith("2 steps in a row (up to step 3)")
    assert torch.equal(p0, p1)


def test_exit_duration_saves_and_stops(tmp_path):
    ck = tmp_path / "ck"
    cfg = small_config(["train.train_iters=50", "train.exit_duration_in_mins=1e-9", f"checkpoint.save={ck}",
                        f"logging.metrics_file={tmp_path / 'm.jsonl'}"])
    state = Trainer(cfg, Topology()).train()
    assert state.iteration == 1 and state.stop_reason == "train.exit_duration_in_mins reached"
    assert os.path.isfile(ck / "iter_0000001" / "meta.json")
