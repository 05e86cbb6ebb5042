"""Launch ``pretrain_gpt.py`` ranks as subprocesses (no torchrun: RANK/WORLD_SIZE/MASTER_* set by hand) so tests can
send them real signals, kill them, and read their exit codes and stderr."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

TINY = """\
model: {num_layers: 2, hidden_size: 64, num_attention_heads: 8, num_query_groups: 4, ffn_hidden_size: 128,
        vocab_size: 256, make_vocab_size_divisible_by: 64}
data: {seq_length: 32, mock_data: true}
train: {micro_batch_size: 2, device: cpu, lr: 1.0e-3, lr_warmup_iters: 0}
logging: {log_interval: 1000, peak_tflops: 0.1}
"""


def write_config(tmp_path) -> str:
    path = os.path.join(str(tmp_path), "tiny.yaml")
    with open(path, "w") as f:
        f.write(TINY)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(rank: int = 0, world: int = 1, port: int = 0) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if world > 1:
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def launch(args: list[str], hook: str = "none", world: int = 1) -> list[subprocess.Popen]:
    """Start ``world`` ranks of ``python -m tests.support.faults_driver HOOK ARGS``; stderr captured, stdout
    discarded."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-m", "tests.support.faults_driver", hook, *args], cwd=ROOT,
                             env=env_for(r, world, port), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
            for r in range(world)]


def finish(procs: list[subprocess.Popen], timeout: float = 120) -> list[tuple[int, str]]:
    """Wait for every rank; kill (by pid) whatever is still running after ``timeout``. Returns (code, stderr)."""
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        out.append((p.returncode, err))
    return out


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()


def wait_for(cond, timeout: float = 90, what: str = "condition", procs=()) -> None:
    t0 = time.monotonic()
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a rank exited ({dead[0].returncode}) while waiting for {what}: "
                                 f"{dead[0].stderr.read()[-2000:]}")
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
