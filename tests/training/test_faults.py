"""Faults with real processes: signals (SIGTERM / SIGUSR1, one rank or through torchrun), a save killed with
SIGKILL, a rank that never joins a collective, broken data files. Each case runs pretrain_gpt.py in subprocesses."""
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.checkpointing.directory import find_latest, read_meta
from megatron_lc.training.loop import Trainer
from tests.support.faults_util import (ROOT, env_for, finish, free_port, kill_all, launch, metrics, wait_for,
                                       write_config)
from tests.support.parity import LOSS_RTOL, small_config


def _run_args(tmp_path, *sets):
    return ["--config", write_config(tmp_path), *[a for s in sets for a in ("--set", s)]]


def _assert_stopped_cleanly(results, ck, mfile):
    for code, err in results:
        assert code == 0, err[-3000:]
        assert "Traceback" not in err
    done = metrics(mfile)[-1]["step"]
    assert 2 <= done < 100000
    latest = find_latest(ck)
    assert latest.endswith(f"iter_{done:07d}")  # the checkpoint is of the last completed step
    assert read_meta(latest)["consumed_samples"] == done * 4
    return done


def test_sigterm_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """SIGTERM reaches rank 1 only; the per-step flag all-reduce makes rank 0 stop after the same step, both save
    one checkpoint together (a rank leaving alone would leave the other hanging in a collective) and exit 0."""
    ck, mfile = tmp_path / "ck", tmp_path / "m.jsonl"
    procs = launch(_run_args(tmp_path, "train.train_iters=100000", "train.global_batch_size=4",
                             f"checkpoint.save={ck}", f"logging.metrics_file={mfile}"), world=2)
    try:
        wait_for(lambda: len(metrics(mfile)) >= 2, what="two steps", procs=procs)
        procs[1].send_signal(signal.SIGTERM)
        results = finish(procs, timeout=60)
    finally:
        kill_all(procs)
    _assert_stopped_cleanly(results, ck, mfile)
    assert "received SIGTERM: stopping after step" in results[0][1]  # rank 0 logs the reason it learnt
    assert sorted(os.listdir(find_latest(ck))) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json",
                                                   "rng_rank00000.pt", "rng_rank00001.pt"]


def test_torchrun_forwards_sigusr1_to_workers(tmp_path):
    """A bare torchrun run: with PET_SIGNALS_TO_HANDLE torchrun forwards SIGUSR1 to its workers, which checkpoint and
    exit (its agent then ends with SignalException, which is why scripts/slurm/launch.sh runs our launcher)."""
    ck, mfile = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()),
           "pretrain_gpt.py",
           *_run_args(tmp_path, "train.train_iters=100000", "train.global_batch_size=4", f"checkpoint.save={ck}",
                      f"logging.metrics_file={mfile}")]
    env = dict(env_for(), PET_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(metrics(mfile)) >= 2, what="two steps", procs=[agent])
        agent.send_signal(signal.SIGUSR1)
        _, err = agent.communicate(timeout=60)
    finally:
        kill_all([agent])
    assert "received SIGUSR1: stopping after step" in err, err[-3000:]
    done = metrics(mfile)[-1]["step"]
    assert find_latest(ck).endswith(f"iter_{done:07d}")


def test_save_killed_midway_leaves_previous_checkpoint_and_resume_uses_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megatron_lc")
    ck, mfile = tmp_path / "ck", tmp_path / "m.jsonl"
    marker = tmp_path / "in_save"
    common = ["train.train_iters=6", "train.global_batch_size=4", "checkpoint.save_interval=2",
              f"checkpoint.save={ck}"]
    procs = launch(_run_args(tmp_path, *common, f"logging.metrics_file={mfile}"),
                   hook=f"hang_in_save:4:{marker}")
    try:
        wait_for(marker.exists, what="the save of iteration 4 to start", procs=procs)
        procs[0].send_signal(signal.SIGKILL)
        code, _ = finish(procs)[0]
    finally:
        kill_all(procs)
    assert code == -signal.SIGKILL
    # run.lock: the killed run's lock (its flock died with it; the next pretrain_gpt.py run takes it over)
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004.tmp", "latest_checkpointed_iteration.txt",
                                      "run.lock"]
    assert os.listdir(ck / "iter_0000004.tmp")  # something was written before the kill
    assert find_latest(str(ck)).endswith("iter_0000002")

    # resume (in this process) picks iteration 2: its steps 3 and 4 repeat the killed run's steps 3 and 4
    killed = metrics(str(mfile))
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    tiny = ["train.train_iters=6", "train.global_batch_size=4", "train.lr=1e-3", "train.lr_warmup_iters=0"]
    resumed = Trainer(small_config(tiny + [f"checkpoint.load={ck}", f"checkpoint.save={ck}",
                                           f"logging.metrics_file={tmp_path / 'r.jsonl'}"]), Topology())
    assert resumed.state.iteration == 2 and resumed.state.consumed_samples == 8
    losses = resumed.train().losses
    # said: the resume ignored the unfinished save, the next save removed it
    assert f"{ck / 'iter_0000004.tmp'}: a save that did not finish, ignored (the next save removes it)" in caplog.text
    assert f"removed {ck / 'iter_0000004.tmp'}: a save that did not finish" in caplog.text
    # tolerance: the killed subprocess and this process may use different thread counts (fp32 sums in another
    # order, ~1e-7 relative); a resume from any other iteration or data position differs by > 1e-3
    np.testing.assert_allclose(losses[:2], [killed[2]["loss"], killed[3]["loss"]], rtol=LOSS_RTOL)
    assert len(losses) == 4
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000006", "latest_checkpointed_iteration.txt", "run.lock"]
    # ... and the save of iteration 6 removed the leftover iter_0000004.tmp


def test_rank_that_never_joins_a_collective_gives_a_clear_error(tmp_path):
    """Rank 1 hangs before step 2; rank 0 waits in step 2's first collective and must fail after
    parallel.distributed_timeout_minutes (0.1 min = 6 s; shorter risks the start-up rendezvous
    timing out on a loaded machine) with one line naming the key, not hang."""
    procs = launch(_run_args(tmp_path, "train.train_iters=5", "train.global_batch_size=4",
                             "parallel.distributed_timeout_minutes=0.1",
                             f"logging.metrics_file={tmp_path / 'm.jsonl'}"), hook="hang_at_step:2:1", world=2)
    t0 = time.monotonic()
    try:
        code, err = finish(procs[:1], timeout=90)[0]
    finally:
        kill_all(procs)
    assert time.monotonic() - t0 < 60
    assert code == 3, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert errors[0].startswith("error: rank 0: a collective did not complete within "
                                "parallel.distributed_timeout_minutes=0.1 (6 s) during step 2")


def _write_data(prefix):
    from megatron_lc.data.indexed import write_indexed

    rng = np.random.default_rng(0)
    write_indexed(prefix, [rng.integers(0, 255, n) for n in (50, 70, 90)])


@pytest.mark.parametrize("damage", ["truncated_bin", "wrong_header"])
def test_broken_data_files_give_one_line_error_before_training(tmp_path, damage):
    prefix = str(tmp_path / "corpus")
    _write_data(prefix)
    if damage == "truncated_bin":
        with open(prefix + ".bin", "r+b") as f:
            f.truncate(os.path.getsize(prefix + ".bin") - 8)
        expect = f"error: {prefix}.bin: size 832 bytes does not match its index (840 bytes expected)"
    else:
        with open(prefix + ".idx", "r+b") as f:
            f.write(b"NOTANIDX!")
        expect = f"error: {prefix}.idx: wrong header b'NOTANIDX!'"
    mfile = tmp_path / "m.jsonl"
    procs = launch(_run_args(tmp_path, "data.mock_data=false", f"data.data_path={prefix}", "data.tokenizer_type=NullTokenizer",
                             f"logging.metrics_file={mfile}", f"checkpoint.save={tmp_path / 'ck'}"))
    code, err = finish(procs)[0]
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(expect), err
    assert not mfile.exists() and not (tmp_path / "ck").exists()  # stopped before any step


def test_resave_killed_between_its_two_renames_keeps_the_old_copy(tmp_path):
    """Re-saving iteration N moves iter_N to iter_N.old, then renames iter_N.tmp to iter_N; killed in between,
    only iter_N.old (and iter_N.tmp) exist: the .old copy is loaded (and kept: it is the only copy of N), and the
    next save removes the stale .tmp."""
    ck = tmp_path / "ck"
    common = ["train.train_iters=2", "train.global_batch_size=2", f"checkpoint.save={ck}",
              f"logging.metrics_file={tmp_path / 'm.jsonl'}"]
    Trainer(small_config(common), Topology()).train()
    os.replace(ck / "iter_0000002", ck / "iter_0000002.old")  # the state a kill between the renames leaves
    (ck / "iter_0000002.tmp").mkdir()
    assert find_latest(str(ck)) == str(ck / "iter_0000002.old")
    resumed = Trainer(small_config(common + ["train.train_iters=3", f"checkpoint.load={ck}"]), Topology())
    assert resumed.state.iteration == 2
    resumed.train()
    assert sorted(os.listdir(ck)) == ["iter_0000002.old", "iter_0000003", "latest_checkpointed_iteration.txt"]
