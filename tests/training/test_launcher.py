"""``pretrain_gpt.py --nproc-per-node 2`` (training/launcher.py) under signals: SIGTERM, SIGUSR1 and Ctrl-C to the
launcher save a checkpoint and exit 0 with no process left; a signal after the last step changes nothing; a second
Ctrl-C stops at once in one line; a SIGKILL of the launcher leaves no rank behind (they save first); an error is said
once whichever rank fails first. Several nodes: node 0 keeps its rendezvous store until the others are done; nodes
that disagree or cannot meet say so in one line. Every wait is on something the ranks write (metrics lines, markers,
exits, store keys), never on a clock."""
from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys

import torch.distributed as dist

from megatron_lc.training.checkpointing.directory import complete_iterations, find_latest
from megatron_lc.training.launcher import NODES_KEY
from tests.support.faults_util import ROOT, env_for, free_port, kill_all, metrics, wait_for, write_config

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


def _signal_when(launcher: subprocess.Popen, tmp_path, ready, what: str, sig) -> tuple[list[int], str]:
    """Once ``ready()``, ``sig`` to the launcher; wait for it to end: (its ranks' pids, its stderr). The ranks are
    killed on the way out when it does not end."""
    ranks = []
    try:
        wait_for(ready, what=what, procs=[launcher])
        ranks = _ranks(launcher)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=120)
    finally:
        kill_all([launcher])
        _kill(ranks, tmp_path)
    return ranks, err


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
        launcher = _start(tmp_path, *sets)
        ranks, err = _signal_when(launcher, tmp_path, lambda: len(metrics(mfile)) > steps + 1, "a step of this run",
                                  sig)
        assert len(ranks) == 2
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
    _, err = _signal_when(launcher, tmp_path, lambda: all(os.path.exists(f"{marker}.{r}") for r in (0, 1)),
                          "both ranks after training", signal.SIGUSR1)
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


# ---- several nodes: the launchers meet through node 0's store (scripts/slurm/launch.sh runs one per node) ----------
NODE = """
import sys
from megatron_lc.training.launcher import Nodes, launch_local
nproc, rank, port, timeout = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
sys.exit(launch_local(nproc, sys.argv[5], [], 60.0, nodes=Nodes(2, rank, "127.0.0.1", port, timeout)))
"""


def _node(tmp_path, nproc: int, rank: int, port: int, join_timeout: float = 60) -> subprocess.Popen:
    """This node's launcher (``launch_local`` with ``Nodes(2, rank)``) whose ranks exit 0 at once."""
    rank_script = tmp_path / "rank.py"
    rank_script.write_text("import sys\nsys.exit(0)\n")
    return subprocess.Popen([sys.executable, "-c", NODE, str(nproc), str(rank), str(port), str(join_timeout),
                             str(rank_script)], cwd=ROOT, env=env_for(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_node_0_keeps_the_rendezvous_store_until_every_node_is_done(tmp_path):
    """The other nodes' ranks may still use node 0's store after node 0's ranks have ended (an error agreed through
    it, the process group's shutdown): node 0's launcher says it is done and then waits for the others (the test
    plays node 1 through the store), so the store is there until node 1 says it is done."""
    port = free_port()
    node0 = _node(tmp_path, 1, 0, port)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=60))
        store.set(f"{NODES_KEY}/nproc/1", "1")  # node 1 joins with one rank
        store.wait([f"{NODES_KEY}/done/0"])  # node 0's rank has ended
        assert store.get(f"{NODES_KEY}/done/0") == b"0" and node0.poll() is None
        store.set(f"{NODES_KEY}/done/1", "0")
        _, err = node0.communicate(timeout=60)
    finally:
        kill_all([node0])
    assert node0.returncode == 0, err
    assert err == f"node 0 of 2: ranks 0..0 of 2, rendezvous store hosted here at 127.0.0.1:{port}\n"


def test_nodes_that_disagree_or_cannot_meet_say_so_in_one_line(tmp_path):
    """Two nodes with different --nproc-per-node: each refuses in one line, exit 2, no rank started. A node whose
    node 0 never comes up: one line naming the address, exit 3 (and no C++ stack of torch's store client)."""
    port = free_port()
    nodes = [_node(tmp_path, 1, 0, port), _node(tmp_path, 2, 1, port)]
    try:
        results = [p.communicate(timeout=120) for p in nodes]
    finally:
        kill_all(nodes)
    for p, (_, err) in zip(nodes, results):
        assert p.returncode == 2 and err.splitlines() == [
            "error: the nodes run different numbers of ranks (node: ranks {0: 1, 1: 2}); every node must have the "
            "same --nproc-per-node"], err
    alone = _node(tmp_path, 1, 1, free_port(), join_timeout=1)
    _, err = alone.communicate(timeout=60)
    assert alone.returncode == 3 and len(err.splitlines()) == 1, err
    assert err.startswith("error: node 1 could not reach the rendezvous store of node 0 at 127.0.0.1:") and \
        "within 1 s (Connection refused): is node 0 running" in err, err


def test_node_arguments_that_cannot_work_are_one_line_and_start_nothing(tmp_path):
    for args, line in [
            (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2"],
             "error: --node-rank must be in 0..1 for --nnodes 2, not 2"),
            (["--nproc-per-node", "1", "--nnodes", "2", "--master-port", "70000"],
             "error: --master-port must be a port number (1..65535) for several nodes, not 70000"),
            (["--nnodes", "2"], "error: --nnodes, --node-rank and --master-port go with --nproc-per-node (this command "
                                "as each node's launcher)")]:
        out = subprocess.run([sys.executable, "pretrain_gpt.py", "--config", write_config(tmp_path), *args], cwd=ROOT,
                             env=env_for(), capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and out.stderr.splitlines() == [line], out.stderr
