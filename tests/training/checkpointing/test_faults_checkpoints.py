"""Checkpoints under faults (training/checkpointing/save.py, checkpoint_dir.py): a state that is not finite is never
saved, saves during skipped steps never prune a good checkpoint, the skip count survives a resume, numbers out of
range are refused, a full disk is one line, a damaged meta.json falls back and a checkpoint that does not load is
set aside. Non-finite values are injected by monkeypatching in the test (the library has no injection switch)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from megatron_lc.config import ConfigError
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.checkpointing.directory import complete_iterations
from megatron_lc.training.checkpointing.save import NonFiniteStateError
from megatron_lc.training.errors import NonFiniteError
from megatron_lc.training.loop import Trainer
from tests.support.parity import small_config
from tests.training.test_faults_nonfinite import _inject
from tests.repo.test_nothing_silent import ROOT, TINY, error_lines

SAVE_EVERY_STEP = ["checkpoint.save_interval=1", "checkpoint.keep_last=2"]


def _trainer(run, iters, *extra, resume=False):
    sets = TINY + [f"train.train_iters={iters}", f"checkpoint.save={run}", f"logging.metrics_file={run}.jsonl",
                   *SAVE_EVERY_STEP, *extra] + ([f"checkpoint.load={run}"] if resume else [])
    return Trainer(small_config(sets), Topology())


@pytest.mark.parametrize("setting, message", [
    ("train.lr=inf", "train.lr (inf) must be a finite number >= 0"),
    ("train.lr=1e39", "train.lr (1e+39) must be a finite number >= 0"),  # past fp32: AdamW's update overflows
    ("train.min_lr=nan", "train.min_lr (nan) must be a finite number >= 0"),
    ("train.global_batch_size=-4", "train.global_batch_size (-4) must be >= 1"),
    ("train.adam_beta1=2", "train.adam_beta1 (2.0) must be in [0, 1)"),
    ("train.adam_beta2=-0.1", "train.adam_beta2 (-0.1) must be in [0, 1)"),
    ("train.weight_decay=-0.1", "train.weight_decay (-0.1) must be a finite number >= 0"),
    ("train.clip_grad=-1", "train.clip_grad (-1.0) must be a finite number >= 0"),
    ("train.adam_eps=0", "train.adam_eps (0.0) must be > 0")])
def test_train_numbers_out_of_range_are_refused(setting, message):
    with pytest.raises(ConfigError) as e:
        small_config([setting])
    assert str(e.value) == message


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_state_that_is_not_finite_is_never_saved(tmp_path, monkeypatch, mode):
    """Steps 1-2 save good checkpoints; step 3's update leaves an inf in a weight (injected after the step): the
    save refuses, the run stops in one line naming the tensor, and both good checkpoints are kept untouched. The
    same with asynchronous saves (checked before staging; step 2's save in flight is finished first)."""
    run = tmp_path / "run"
    original = Trainer.train_step

    def poisoned(self, step):
        rec = original(self, step)
        if step + 1 == 3:
            next(self.model.parameters()).data.view(-1)[5] = math.inf
        return rec

    monkeypatch.setattr(Trainer, "train_step", poisoned)
    with pytest.raises(NonFiniteStateError) as e:
        _trainer(run, 6, f"checkpoint.async_save={mode == 'async'}").train()
    assert str(e.value) == (f"not saving iteration 3: the state is not finite (rank 0: model/embedding.weight); the "
                            f"newest checkpoint is kept: {run / 'iter_0000002'}. Resume from it with a lower train.lr "
                            f"or more warmup")
    assert sorted(os.listdir(run)) == ["iter_0000001", "iter_0000002", "latest_checkpointed_iteration.txt"]


def test_skipped_steps_never_prune_good_checkpoints_and_their_count_survives_resume(tmp_path, monkeypatch):
    """Steps 3-5 are non-finite (skipped) and still saved, keep_last 2: the good checkpoints 1 and 2 stay. The
    resume from 5 goes on counting (3 in a row saved in its meta.json): with a limit of 4, step 6 stops the run;
    counting from 0 again it would skip 6-8 and finish with exit 0."""
    run = tmp_path / "run"
    _inject(monkeypatch, set(range(3, 100)), "loss")
    state = _trainer(run, 5, "train.max_consecutive_skipped_steps=10").train()
    assert state.skipped_steps == 3
    assert complete_iterations(str(run)) == [1, 2, 3, 4, 5]
    meta = json.loads((run / "iter_0000005" / "meta.json").read_text())
    assert (meta["skipped_in_a_row"], meta["skipped_steps"]) == (3, 3)
    with pytest.raises(NonFiniteError, match=r"^4 steps in a row \(up to step 6\)"):
        _trainer(run, 8, "train.max_consecutive_skipped_steps=4", resume=True).train()
    assert complete_iterations(str(run)) == [1, 2, 3, 4, 5]
    # a good step again: the checkpoints of the skipped run are pruned as usual (keep_last 2 good ones: 2 and 6)
    monkeypatch.undo()
    _trainer(run, 6, "train.max_consecutive_skipped_steps=4", resume=True).train()
    assert complete_iterations(str(run)) == [2, 3, 4, 5, 6]


def test_truncated_newest_meta_json_falls_back_like_a_corrupt_file(tmp_path, caplog):
    run = tmp_path / "run"
    _trainer(run, 2).train()
    meta = run / "iter_0000002" / "meta.json"
    truncated = meta.read_text()[:100]
    meta.write_text(truncated)
    resumed = _trainer(run, 3, resume=True)
    assert resumed.state.iteration == 1
    assert f"because {meta} is unreadable or truncated (" in caplog.text
    assert f"set aside {run / 'iter_0000002'} as {run / 'iter_0000002.corrupt'}: it does not load" in caplog.text
    resumed.train()
    assert sorted(os.listdir(run)) == ["iter_0000002", "iter_0000002.corrupt", "iter_0000003",
                                       "latest_checkpointed_iteration.txt"]
    assert (run / "iter_0000002.corrupt" / "meta.json").read_text() == truncated


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.path.insert(0, {root!r})
import pretrain_gpt
sys.exit(pretrain_gpt.main(sys.argv[2:]))
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, mode):
    """A file-size limit stands in for a full disk: the first save (small: weights of step 1 without AdamW states
    would not do, so the limit is between the sizes of the two saves' data files) fails in one line naming the file
    and the cause, exit 3; the previous checkpoint stays and no partial directory is left. Asynchronous: the
    background write fails, and the next save, which waits for it, says so in the same line."""
    run = tmp_path / "run"
    _trainer(run, 1).train()
    size = (run / "iter_0000001" / "__0_0.distcp").stat().st_size
    script = tmp_path / "limited.py"
    script.write_text(FULL_DISK.format(root=ROOT))
    cmd = [sys.executable, str(script), str(size // 2), "--config", "configs/tiny_cpu.yaml"]
    for s in TINY + ["train.train_iters=3", f"checkpoint.save={run}", f"checkpoint.load={run}",
                     "checkpoint.save_interval=1", f"checkpoint.async_save={mode == 'async'}"]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    assert out.returncode == 3, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert error_lines(out.stderr) == [
        f"error: could not write checkpoint {run / 'iter_0000002'} ({run / 'iter_0000002.tmp'}: "
        f"File too large (this process may write files of at most {size // 2} bytes: ulimit -f)); the previous "
        f"checkpoint is kept: {run / 'iter_0000001'}"], out.stderr[-3000:]
    assert complete_iterations(str(run)) == [1] and not (run / "iter_0000002.tmp").exists()
    # what a job script reads (scripts/slurm/launch.sh): failed, with the same line -- no requeue
    assert (run / "run_outcome.txt").read_text() == error_lines(out.stderr)[0].replace("error: ", "failed: ", 1) + "\n"


def test_a_failure_on_one_rank_is_the_same_line_on_every_rank(tmp_path):
    """Rank 1 alone cannot write (a 100-byte file-size limit): both ranks raise the same error naming rank 1's
    cause, the partial save is removed and iteration 2 stays. Then rank 1's RNG file is planted: both ranks refuse
    it (rank 0's own file is fine), and the payload never runs."""
    from tests.dist_cases import checkpoint as dist_cases_checkpoint
    from tests.support.dist import run_dist

    run, marker = tmp_path / "run", tmp_path / "ran"
    results = run_dist(2, dist_cases_checkpoint.rank1_faults, str(run), str(marker))
    (save0, load0, ran0), (save1, load1, ran1) = results
    assert save0 == save1 == (
        f"could not write checkpoint {run / 'iter_0000003'} (rank 1: {run / 'iter_0000003.tmp'}: File too large (this "
        f"process may write files of at most 100 bytes: ulimit -f)); the previous checkpoint is kept: "
        f"{run / 'iter_0000002'}")
    assert load0 == load1 and load0.startswith(f"{run / 'iter_0000002' / 'rng_rank00001.pt'} holds pickled Python "
                                               f"objects, not only tensors")
    assert not ran0 and not ran1 and not marker.exists()
    assert complete_iterations(str(run)) == [2] and not (run / "iter_0000003.tmp").exists()
