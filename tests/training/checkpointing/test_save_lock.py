"""One run per checkpoint.save directory (training/checkpointing/lock.py): a second run is one line naming the holder, a
dead run's lock is taken over and said, a lock of another machine is refused with the file to remove."""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys

import pytest

from megatron_lc.config import ConfigError
from megatron_lc.training import entry
from megatron_lc.training.checkpointing.directory import complete_iterations
from megatron_lc.training.checkpointing.lock import LOCK, SaveLock
from tests.support.faults_util import finish, kill_all, launch, metrics, wait_for, write_config
from tests.support.parity import small_config
from tests.repo.test_nothing_silent import TINY, assert_one_error, pretrain


def test_a_second_run_on_a_save_directory_is_one_line_and_deletes_nothing(tmp_path):
    """Run A trains (a marker after its step 1); run B, the same command (load == save, as an auto-resuming job),
    is refused naming A's host and pid and touches nothing; A then stops on SIGTERM, saves and exits 0, and its
    metrics hold its own steps only."""
    ck, mfile, marker = tmp_path / "ck", tmp_path / "m.jsonl", tmp_path / "step1"
    sets = ["train.train_iters=100000", "train.global_batch_size=4", f"checkpoint.save={ck}", f"checkpoint.load={ck}",
            f"logging.metrics_file={mfile}"]
    a = launch(["--config", write_config(tmp_path), *[x for s in sets for x in ("--set", s)]],
               hook=f"marker_after_step:1:{marker}")
    try:
        wait_for(marker.exists, what="run A's first step", procs=a)
        holder = json.loads((ck / LOCK).read_text())
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), a[0].pid)
        before = sorted(os.listdir(ck))
        out = pretrain(*TINY, *sets)
        assert_one_error(out, f"checkpoint.save ({ck}) is in use by another run (host {socket.gethostname()}, pid "
                              f"{a[0].pid}, since {holder['since']}): wait for it to end, or save this run to another "
                              f"directory")
        assert sorted(os.listdir(ck)) == before
        a[0].send_signal(signal.SIGTERM)
        (code, err), = finish(a, timeout=120)
    finally:
        kill_all(a)
    assert code == 0, err[-3000:]
    steps = [r["step"] for r in metrics(str(mfile))]
    assert steps == list(range(1, len(steps) + 1))  # one run's steps, in order
    assert complete_iterations(str(ck)) == [steps[-1]] and not (ck / LOCK).exists()


def test_the_lock_of_a_dead_run_is_taken_over_and_said(tmp_path, caplog):
    save = tmp_path / "run"
    save.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = {"host": socket.gethostname(), "pid": dead.pid, "since": "2025-01-01 00:00:00"}
    (save / LOCK).write_text(json.dumps(stale))  # its flock died with it
    caplog.set_level(logging.WARNING, logger="megatron_lc")
    state = entry.run(small_config(TINY + ["train.train_iters=1", f"checkpoint.save={save}"]))
    assert state.iteration == 1
    assert (f"checkpoint.save ({save}): took over the lock of a run that is no longer running (host "
            f"{socket.gethostname()}, pid {dead.pid}, since 2025-01-01 00:00:00)") in caplog.text
    assert complete_iterations(str(save)) == [1] and not (save / LOCK).exists()


def test_a_lock_of_another_machine_is_refused_unless_it_is_this_job_requeued(tmp_path, monkeypatch):
    save = tmp_path / "run"
    save.mkdir()
    other = json.dumps({"host": "node-elsewhere", "pid": 4242, "since": "2025-01-01 00:00:00", "job": "77"})
    (save / LOCK).write_text(other)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError) as e:
        SaveLock(str(save)).acquire()
    assert str(e.value) == (f"checkpoint.save ({save}) is locked by a run on another machine (host node-elsewhere, "
                            f"pid 4242, since 2025-01-01 00:00:00, SLURM job 77), which cannot be checked from "
                            f"{socket.gethostname()}: if that run has ended, remove {save / LOCK}")
    assert (save / LOCK).read_text() == other
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # the same job, requeued onto another node
    lock = SaveLock(str(save))
    lock.acquire()
    assert json.loads((save / LOCK).read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(save) == []


def test_a_directory_made_for_the_lock_alone_is_removed_with_it(tmp_path):
    """A run that fails before its first save leaves no trace (see also test_faults.py's broken data files)."""
    lock = SaveLock(str(tmp_path / "new"))
    lock.acquire()
    assert os.listdir(tmp_path / "new") == [LOCK]
    lock.release()
    assert not (tmp_path / "new").exists()
