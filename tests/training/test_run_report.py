"""What a run tells its user at its start and at its end: the intra-op threads it chose, in the log's first line; the
one-line summary it ends with (steps, first and last loss, the mean of the last ten, time, where the checkpoint and
metrics are), its figures those of the metrics file; a finished run's "nothing to do" before any GEMM is timed; MFU's
baseline as the median of short GEMMs timed for half a second, said with its spread; under plain torchrun, a config
mistake as the root cause of torchrun's own summary (the rank's error file)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from megatron_lc.training import metrics
from megatron_lc.training.logger import format_summary
from megatron_lc.training.process_group import choose_threads

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=32", "data.mock_data=true", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.device=cpu"]


def pretrain(*sets: str, launcher=(sys.executable,), config="configs/tiny_cpu.yaml") -> subprocess.CompletedProcess:
    """``pretrain_gpt.py --config CONFIG --set ...`` from the repository root, with no OMP_NUM_THREADS: the run
    chooses its threads."""
    cmd = [*launcher, "pretrain_gpt.py", "--config", config]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return subprocess.run(cmd, cwd=ROOT, env=dict(env, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)


def log_lines(stderr: str) -> list[str]:
    """The log's messages (``[HH:MM:SS rank0] message`` -> ``message``)."""
    return [re.sub(r"^\[[0-9:]+ rank\d+\] ", "", ln) for ln in stderr.splitlines() if re.match(r"\[[0-9:]+ rank", ln)]


def test_threads_fit_the_free_cores():
    assert choose_threads(2, 1, 6.2) == 1  # a busy 2-core machine: one thread (the demo's model ran 6x faster)
    assert choose_threads(2, 1, 0.2) == 2 and choose_threads(2, 2, 0.2) == 1 and choose_threads(64, 8, 3.0) == 7
    assert choose_threads(1, 4, 0.0) == 1  # never none


def test_a_run_says_its_threads_first_and_ends_with_its_summary_and_a_finished_one_times_no_gemm(tmp_path):
    run = tmp_path / "run"
    out = pretrain(*TINY, "train.train_iters=12", f"checkpoint.save={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = log_lines(out.stderr)
    m = re.fullmatch(r"intra-op threads: (\d+) a rank \((\d+) cores available, 1-minute load [0-9.]+; "
                     r"OMP_NUM_THREADS sets another\)", lines[0])
    assert m and 1 <= int(m[1]) <= int(m[2]) == len(os.sched_getaffinity(0)), lines[:2]
    assert re.search(r"MFU is relative to [0-9.e+-]+ TFLOP/s per rank \(measured: fp32 GEMM 256x256, median of "
                     r"\d+ over 0.5 s", out.stderr)
    losses = [json.loads(ln)["loss"] for ln in open(run / "metrics.jsonl")]
    took = r"(?:\d+ min \d\d s|[0-9.]+ s)"
    done = re.fullmatch(rf"done: steps 1-12 of 12 in {took} \(the process: {took}\) \| loss (\S+) at step 1, (\S+) at "
                        r"step 12, mean (\S+) over steps 3-12 \| checkpoint (\S+) \| metrics (\S+)", lines[-1])
    assert done, lines[-1]
    assert [float(done[k]) for k in (1, 2, 3)] == [round(losses[0], 4), round(losses[-1], 4),
                                                   round(sum(losses[2:]) / 10, 4)]
    assert (done[4], done[5]) == (str(run / "iter_0000012"), str(run / "metrics.jsonl"))

    again = pretrain(*TINY, "train.train_iters=12", f"checkpoint.save={run}", f"checkpoint.load={run}")
    assert again.returncode == 0 and "nothing to do: the checkpoint is at iteration 12" in again.stderr
    assert "MFU is relative" not in again.stderr  # said at once: no GEMM timed for a run with nothing to do


def test_the_summary_of_a_stopped_run_without_a_checkpoint_and_with_skipped_steps():
    line = format_summary(5, [3.0, float("nan"), 2.0], 100, 75.0, 80.0, "received SIGTERM", None, None)
    assert line == ("stopped (received SIGTERM): steps 5-7 of 100 in 1 min 15 s (the process: 1 min 20 s) | loss "
                    "3.0000 at step 5, 2.0000 at step 7, mean 2.5000 over steps 5-7 (1 skipped) | no checkpoint "
                    "(checkpoint.save unset) | metrics on the console only")
    assert format_summary(1, [None, None], 2, 9.0, None, None, "c/iter_0000002", "m.jsonl") == (
        "done: steps 1-2 of 2 in 9.0 s | checkpoint c/iter_0000002 | metrics m.jsonl")  # a rehearsal


def test_the_gemm_baseline_is_the_median_of_half_a_second_of_gemms(monkeypatch):
    """One GEMM of every few slowed 20-fold (another job took the cores): the median keeps the machine's rate, where
    the mean or a single timing would follow the slow ones."""
    calls = {"mm": 0}
    real_mm, clock = torch.mm, {"t": 0.0}

    def mm(a, b):
        calls["mm"] += 1
        clock["t"] += 0.6 if calls["mm"] % 4 == 0 else 0.03  # every 4th GEMM 20 times slower
        return real_mm(a, b)

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock["t"])
    median, rates = metrics.measure_peak.__wrapped__(torch.device("cpu"), torch.float32, 64)
    fast = 2.0 * 64 ** 3 / 0.03
    assert len(rates) >= metrics.BASELINE_SAMPLES[0] and abs(median - fast) < 1e-6 * fast
    assert min(rates) < fast / 10  # the slow ones were timed, and left out by the median
    monkeypatch.undo()


def test_under_torchrun_a_config_mistake_is_torchrun_s_root_cause(tmp_path):
    """``torchrun --nproc-per-node 3`` of the ring config (cp 2 does not divide 3 ranks): each rank writes its line
    to its error file, and torchrun's summary ends with it as the root cause (not "To enable traceback see")."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = pretrain(f"checkpoint.save={tmp_path / 'ring'}", launcher=(torchrun, "--nproc-per-node", "3"),
                   config="configs/tiny_cpu_cp_ring.yaml")
    message = "error: world size (3) must be divisible by tp (1) x cp (2) = 2"
    assert out.returncode != 0 and [ln for ln in out.stderr.splitlines() if ln.startswith("error:")] == [message]
    root = out.stderr[out.stderr.index("Root Cause (first observed failure):"):]
    assert f"traceback : {message}" in root and "To enable traceback" not in out.stderr, root
