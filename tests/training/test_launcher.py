"""``pretrain_gpt.py --nproc-per-node 2`` (training/launcher.py) under signals: SIGTERM, SIGUSR1 and Ctrl-C to the
launcher save a checkpoint and exit 0 with no process left; a signal after the last step changes nothing; a second
Ctrl-C stops at once in one line; a SIGKILL of the launcher leaves no rank behind (they save first); an error is said
once whichever rank fails first. Every wait is on something the ranks write (metrics lines, markers, exits), never on a clock."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

from megatron_lc.training.checkpointing.directory import complete_iterations, find_latest
from tests.support.faults_util import ROOT, env_for, kill_all, metrics, wait_for, write_config

WORLD = ["train.global_batch_size=4", "train.train_iters=100000"]


def _start(tmp_path, *sets, script=("pretrain_gpt.py", "--nproc-per-node", "2"), hook=(), stderr=subprocess.PIPE):
    cmd = [sys.executable, *script, *hook, "--config", write_config(tmp_path)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, cwd=ROOT, env=env_for(), stdout=subprocess.DEVNULL, stderr=stderr, text=True)


def _ranks(launcher: subprocess.Popen) -> list[int]:
    with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _kill(pids: list[int], tmp_path) -> None:
    """Clean up after a failed test: the ranks (a hook may hold them in a 10-minute sleep), each only while its
    command line still names this test's directory (a pid is reused once its process is gone)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(tmp_path).encode() in f.read():
                    os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent counts as gone
        return f.read().split(")")[-1].split()[0] == "Z"


def test_stop_signals_to_the_launcher_save_and_exit_0_with_no_process_left(tmp_path):
    """SIGTERM, then SIGUSR1, then Ctrl-C (SIGINT), each to the launcher of a run resumed from the last: the ranks
    finish the step, save it, exit 0; the launcher exits 0 without a traceback or an error line."""
    ck, mfile = tmp_path / "ck", tmp_path / "m.jsonl"
    sets = [*WORLD, f"checkpoint.save={ck}", f"checkpoint.load={ck}", f"logging.metrics_file={mfile}"]
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        steps = len(metrics(mfile))
        launcher, ranks = _start(tmp_path, *sets), []
        try:
            wait_for(lambda: len(metrics(mfile)) > steps + 1, what="a step of this run", procs=[launcher])
            ranks = _ranks(launcher)
            assert len(ranks) == 2
            launcher.send_signal(sig)
            _, err = launcher.communicate(timeout=120)
        finally:
            kill_all([launcher])
            _kill(ranks, tmp_path)
        assert launcher.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "error:" not in err, err[-3000:]
        assert f"received {sig.name}: stopping after step" in err
        done = metrics(mfile)[-1]["step"]
        assert find_latest(str(ck)).endswith(f"iter_{done:07d}")
        assert all(_gone(p) for p in ranks)


def test_a_stop_signal_after_the_last_step_changes_nothing(tmp_path):
    """SIGUSR1 to the launcher once both ranks have returned from training (a test hook holds each there until the
    signal reaches it): by its default action it would kill them on their way out (exit 138 for a run that
    finished); they say it and end the run as before: exit 0, and the run's outcome file says it finished."""
    ck, marker = tmp_path / "ck", tmp_path / "trained"
    launcher = _start(tmp_path, "train.global_batch_size=4", "train.train_iters=2", f"checkpoint.save={ck}",
                      script=("-m", "tests.support.launch_driver", "2"), hook=(f"signal_after_training:{marker}",))
    ranks = []
    try:
        wait_for(lambda: all(os.path.exists(f"{marker}.{r}") for r in (0, 1)), what="both ranks after training",
                 procs=[launcher])
        ranks = _ranks(launcher)
        launcher.send_signal(signal.SIGUSR1)
        _, err = launcher.communicate(timeout=120)
    finally:
        kill_all([launcher])
        _kill(ranks, tmp_path)
    assert launcher.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert "received SIGUSR1 after the last step: nothing to stop, the run is ending" in err
    assert (ck / "run_outcome.txt").read_text().startswith("finished: iteration 2 of train.train_iters=2, checkpoint ")
    assert complete_iterations(str(ck)) == [2]


def test_second_ctrl_c_stops_at_once_in_one_line(tmp_path):
    """Both ranks hang in the save of iteration 2 (a test hook); Ctrl-C twice: exit 130 at once, one line, the
    unfinished save left aside, no process left."""
    ck, marker, log = tmp_path / "ck", tmp_path / "in_save", tmp_path / "stderr"
    with open(log, "w") as stderr:
        launcher = _start(tmp_path, *WORLD, f"checkpoint.save={ck}", "checkpoint.save_interval=2",
                          f"logging.metrics_file={tmp_path / 'm.jsonl'}",
                          script=("-m", "tests.support.launch_driver", "2"),
                          hook=(f"hang_in_save:2:{marker}",), stderr=stderr)
    ranks = []
    try:
        wait_for(marker.exists, what="the save of iteration 2", procs=[launcher])
        ranks = _ranks(launcher)
        launcher.send_signal(signal.SIGINT)
        # two signals sent at once may arrive as one: the second goes once rank 0 has said it got the first
        wait_for(lambda: "received SIGINT: finishing this step" in log.read_text(), what="the first Ctrl-C")
        launcher.send_signal(signal.SIGINT)
        launcher.wait(timeout=120)
    finally:
        kill_all([launcher])
        _kill(ranks, tmp_path)
    err = log.read_text()
    assert launcher.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if "error:" in ln] == [
        "error: interrupted again (Ctrl-C twice): stopped at once, without saving"], err[-3000:]
    assert complete_iterations(str(ck)) == [] and (ck / "iter_0000002.tmp").is_dir()
    assert all(_gone(p) for p in ranks)


def test_ranks_outlive_a_killed_launcher_only_to_save(tmp_path):
    """SIGKILL to the launcher: the kernel sends each rank SIGTERM (PR_SET_PDEATHSIG), so they save and exit."""
    ck, mfile = tmp_path / "ck", tmp_path / "m.jsonl"
    launcher, ranks = _start(tmp_path, *WORLD, f"checkpoint.save={ck}", f"logging.metrics_file={mfile}"), []
    try:
        wait_for(lambda: len(metrics(mfile)) >= 1, what="a step", procs=[launcher])
        ranks = _ranks(launcher)
        launcher.send_signal(signal.SIGKILL)
        launcher.communicate(timeout=60)
        wait_for(lambda: all(_gone(p) for p in ranks), timeout=120, what="the ranks to save and exit")
    finally:
        kill_all([launcher])
        _kill(ranks, tmp_path)
    done = metrics(mfile)[-1]["step"]
    assert complete_iterations(str(ck)) == [done]


def test_an_error_is_said_once_when_another_rank_fails_first(tmp_path):
    """Rank 1 reaches its error first and rank 0 only after it (a test hook orders them with a marker file): the
    line is still said once, by rank 0; a wait of 2 s, as before, would have let rank 1 speak too."""
    launcher = _start(tmp_path, "checkpoint.save=null", "data.mock_data=false", f"data.data_path={tmp_path}/none",
                      "data.tokenizer_type=NullTokenizer", script=("-m", "tests.support.launch_driver", "2"),
                      hook=(f"rank1_fails_first:{tmp_path / 'rank1_failed'}",))
    try:
        _, err = launcher.communicate(timeout=300)
    finally:
        kill_all([launcher])
    assert launcher.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if "error:" in ln] == [
        f"error: data file not found: {tmp_path}/none.bin (data.data_path is the prefix of a .bin/.idx pair; make one "
        f"with tools/preprocess_data.py)"], err[-3000:]
    assert (tmp_path / "rank1_failed").exists()
