"""Asynchronous checkpoints (``checkpoint.async_save``; training/checkpointing/async_save.py): the checkpoints are those
of a
synchronous save bit for bit although training goes on while they are written; a resume from them continues the run
bit for bit, also on 2 ranks at another layout; a process killed while a save is in flight leaves the previous
checkpoint the newest that loads, and the next run says so."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import torch

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.checkpointing.directory import complete_iterations, read_meta
from megatron_lc.training.loop import Trainer
from megatron_lc.training.checkpointing.sharded_state import full_model_state
from tests.dist_cases import faults as dist_cases_faults
from tests.support.dist import run_dist
from tests.support.parity import small_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BASE = ["train.global_batch_size=4", "logging.peak_tflops=1", "checkpoint.save_interval=2",
        "train.lr_decay_iters=6"]  # the same schedule for 4- and 6-step runs


def _run(tmp_path, name, *extra, iters=4):
    cfg = small_config(BASE + [f"train.train_iters={iters}", f"checkpoint.save={tmp_path / name}"] + list(extra))
    return Trainer(cfg, Topology()).train(), cfg


def test_async_checkpoints_equal_sync_ones_and_resume_exactly(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_lc")
    _, cfg = _run(tmp_path, "sync")
    _run(tmp_path, "async", "checkpoint.async_save=true")
    assert complete_iterations(str(tmp_path / "async")) == [2, 4] and "written in the background" in caplog.text
    for it in (2, 4):  # training went on while iteration 2 was written: the staged copy is what was saved
        a, s = (str(tmp_path / d / f"iter_{it:07d}") for d in ("async", "sync"))
        wa, ws = full_model_state(a, cfg), full_model_state(s, cfg)
        assert wa.keys() == ws.keys() and all(torch.equal(wa[k], ws[k]) for k in wa)
        assert read_meta(a)["files"].keys() == read_meta(s)["files"].keys()
    straight, _ = _run(tmp_path, "straight", iters=6)
    resumed, _ = _run(tmp_path, "async", "checkpoint.async_save=true", f"checkpoint.load={tmp_path / 'async'}",
                      iters=6)
    assert resumed.losses == straight.losses[4:]


def test_the_staging_area_is_made_once_pinned_on_cuda_reused_and_budgeted(tmp_path, monkeypatch):
    """DCP's ``async_save`` without a stager stages every save into fresh pageable memory (state_dict_saver.py:
    ``DefaultStager(StagingOptions(False, False, False, False))``, closed after the write). The checkpointer keeps one
    stager for the run -- page-locked with non-blocking copies on CUDA (``staging_options``) -- and two saves stage
    into the very same host storages; setup holds its exact bytes beside the host pool, in the budget (every
    storage of the rank's state: weights, AdamW's two moments, step counts)."""
    from megatron_lc.training.checkpointing import async_save as A

    cuda = A.staging_options(torch.device("cuda"))
    assert cuda.use_pinned_memory and cuda.use_non_blocking_copy and not cuda.use_async_staging
    assert not A.staging_options(torch.device("cpu")).use_pinned_memory  # (pinning needs CUDA)
    made, staged = [], []
    real_stager, real_stage = A.DefaultStager, A.DefaultStager.stage
    monkeypatch.setattr(A, "DefaultStager", lambda options: made.append(options) or real_stager(options))
    monkeypatch.setattr(real_stager, "stage", lambda self, state, **kw: staged.append(real_stage(self, state, **kw))
                        or staged[-1])
    cfg = small_config(BASE + ["train.train_iters=4", f"checkpoint.save={tmp_path / 'a'}",
                               "checkpoint.async_save=true"])
    trainer = Trainer(cfg, Topology())
    trainer.train()
    assert len(made) == 1 and len(staged) == 2  # one stager, two saves through it
    first, second = staged
    assert first.keys() == second.keys() and all(
        first[k].untyped_storage().data_ptr() == second[k].untyped_storage().data_ptr() for k in first)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in first.values()}
    assert trainer.ctx.host_pool.beside[A.STAGING] == sum(storages.values())


def test_async_on_two_ranks_resumes_at_another_layout(tmp_path):
    ck = str(tmp_path / "ck")
    common = ["train.global_batch_size=4", "train.micro_batch_size=2", "checkpoint.save_interval=2",
              "train.lr_decay_iters=6"]
    first = run_dist(2, dist_cases_faults.record_sample_ids,
                     common + ["train.train_iters=4", f"checkpoint.save={ck}", "checkpoint.async_save=true"])
    assert complete_iterations(ck) == [2, 4]
    second = run_dist(2, dist_cases_faults.record_sample_ids,
                      common + ["train.train_iters=6", f"checkpoint.save={ck}", f"checkpoint.load={ck}",
                                "checkpoint.async_save=true", "parallel.context_parallel_size=2"])
    straight = run_dist(2, dist_cases_faults.record_sample_ids, common + ["train.train_iters=6"])
    # fp32 CPU; another layout only reorders sums (1e-5 relative, the project's contract)
    for a, b in zip(second[0][2], straight[0][2][4:]):
        assert abs(a - b) <= 1e-5 * abs(b)
    assert first[0][1] == 16 and second[0][1] == 24


KILLED = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.checkpointing import async_save as async_checkpoint
    from megatron_lc.training.loop import Trainer
    from tests.support.parity import small_config

    start = async_checkpoint.AsyncCheckpointer.save

    def save_then_die(self, model, opt, iteration, *args):
        path = start(self, model, opt, iteration, *args)
        if iteration == 4:  # staged, written in the background or not yet: never finished
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    async_checkpoint.AsyncCheckpointer.save = save_then_die
    Trainer(small_config({sets!r}), Topology()).train()
""")


def test_killed_while_a_save_is_in_flight(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_lc")
    save = tmp_path / "run"
    sets = BASE + ["train.train_iters=6", f"checkpoint.save={save}", "checkpoint.async_save=true"]
    out = subprocess.run([sys.executable, "-c", KILLED.format(root=ROOT, sets=sets)], cwd=ROOT, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert out.returncode == -9, out.stderr[-2000:]
    assert complete_iterations(str(save)) == [2] and (save / "iter_0000004.tmp").is_dir()
    assert not (save / "iter_0000004.tmp" / "meta.json").exists()
    cfg = small_config(sets + [f"checkpoint.load={save}"])
    trainer = Trainer(cfg, Topology())
    assert trainer.setup.resumed["iteration"] == 2
    assert f"{save / 'iter_0000004.tmp'}: a save that did not finish, ignored (the next save removes it)" in caplog.text
    state = trainer.train()
    assert state.iteration == 6 and complete_iterations(str(save)) == [2, 4, 6]
    assert not (save / "iter_0000004.tmp").exists()
