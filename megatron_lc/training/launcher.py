"""``--nproc-per-node N`` of the command-line scripts (``pretrain_gpt.py``, ``tools/eval_long.py``): N local ranks,
started, signalled and waited for by this process, after the script has checked its config for N ranks.

    launch_local(2, "pretrain_gpt.py", worker_args(sys.argv[1:]), grace_s=600) -> exit code

What it does, as ``scripts/slurm/launch.sh`` asks torchrun to (``--signals-to-handle``, a shutdown timeout):
- starts the ranks as ``torch.distributed`` workers of one node (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT),
  each in its own session, so a terminal's Ctrl-C reaches this process alone and is forwarded once; the rendezvous
  store is hosted here (torchrun's "agent store"), so it outlives every rank -- which rank reports an error is
  agreed through it (``training/entry.py``);
- forwards SIGTERM, SIGINT and SIGUSR1 to every rank: the ranks finish the step, save and exit 0
  (``training/faults.StopControl``; a second SIGINT stops them at once), and this process waits up to ``grace_s``
  for that save before it kills them (SIGKILL, said in one line);
- when a rank exits with an error, kills the others (a rank that lost a peer can only wait for a timeout) and
  exits with that rank's code; the rank printed its own line, this process adds nothing (no launcher traceback);
  a rank killed by a signal is one line here (exit 128 + the signal);
- ranks follow this process: each asks the kernel for SIGTERM when it dies (``follow_launcher``), so even a
  SIGKILL of this process leaves no rank behind, and the SIGTERM makes them save first.

Why not torchrun's launcher in-process (it was, before): on a forwarded signal its agent raises ``SignalException``
(a 40-line traceback and exit 1 however the workers ended), and it does not report the workers' exit codes.
Several nodes: torchrun per node, as ``scripts/slurm/launch.sh`` does.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import torch.distributed as dist

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_PID = "MEGATRON_LC_LAUNCHER_PID"
OWN_FLAGS = ("--nproc-per-node", "--shutdown-grace")  # the launcher's arguments, not the ranks'


def worker_args(argv: list[str]) -> list[str]:
    """The ranks' arguments: every one but the launcher's own (``OWN_FLAGS``, as ``--flag N`` or ``--flag=N``).

    >>> worker_args(["--config", "x.yaml", "--nproc-per-node", "2", "--shutdown-grace=60", "--set", "a.b=1"])
    ['--config', 'x.yaml', '--set', 'a.b=1']
    """
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in OWN_FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in OWN_FLAGS)):
            out.append(a)
    return out


def follow_launcher() -> None:
    """In a rank started by ``launch_local``: SIGTERM from the kernel when the launcher dies (Linux)."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher):  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class _Ranks:
    """The running ranks and the signals forwarded to them."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.stop_signal: Optional[int] = None
        self.stop_time: Optional[float] = None

    def forward(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal, self.stop_time = signum, time.monotonic()
        self.signal_all(signum)

    def signal_all(self, signum: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass


def _env(rank: int, world: int, port: int) -> dict:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
               GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    env[LAUNCHER_PID] = str(os.getpid())
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several local ranks
    return env


def launch_local(nproc: int, script: str, args: list[str], grace_s: float, saves: bool = True) -> int:
    """Run ``python script args`` as ``nproc`` ranks (see module doc); returns the exit code to end with.
    ``saves``: the ranks stop on a forwarded signal by saving (``pretrain_gpt.py``); ``tools/eval_long.py``'s
    ranks have nothing to save and a forwarded SIGTERM ends them."""
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    ranks = _Ranks([])
    previous = {s: signal.signal(s, ranks.forward) for s in FORWARDED}  # before any rank exists: none is missed
    try:
        for r in range(nproc):
            ranks.procs.append(subprocess.Popen([sys.executable, script, *args], env=_env(r, nproc, store.port),
                                                start_new_session=True))
        return _wait(ranks, grace_s, saves)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        ranks.signal_all(signal.SIGKILL)


def _wait(ranks: _Ranks, grace_s: float, saves: bool) -> int:
    """Wait for every rank; the first that exits with an error decides the code and the others are killed."""
    first: Optional[tuple[int, int]] = None  # (rank, exit code)
    while any(p.poll() is None for p in ranks.procs):
        if first is None:
            failed = [(r, p.returncode) for r, p in enumerate(ranks.procs) if p.returncode not in (None, 0)]
            if failed:
                first = failed[0]
                ranks.signal_all(signal.SIGKILL)
        if ranks.stop_time is not None and time.monotonic() - ranks.stop_time > grace_s:
            ranks.signal_all(signal.SIGKILL)
            name = signal.Signals(ranks.stop_signal).name
            print(f"error: the ranks did not stop within {grace_s:g} s of {name}: killed (the checkpoint of this "
                  f"stop may be missing; --shutdown-grace sets the wait)", file=sys.stderr, flush=True)
            for p in ranks.procs:
                p.wait()
            return 128 + signal.SIGKILL
        time.sleep(0.05)  # polls the ranks; signals are handled in between
    if first is None:
        failed = [(r, p.returncode) for r, p in enumerate(ranks.procs) if p.returncode != 0]
        first = failed[0] if failed else None
    if first is None:
        return 0
    rank, code = first
    if code > 0:
        return code
    name = signal.Signals(-code).name
    if ranks.stop_signal == -code and saves:  # stopped by the signal forwarded to it, before it could save (setup)
        print(f"error: {name} before training began: the ranks stopped without saving", file=sys.stderr, flush=True)
    elif ranks.stop_signal == -code:
        print(f"error: stopped by {name}", file=sys.stderr, flush=True)
    else:
        print(f"error: rank {rank} was killed by signal {-code} ({name})", file=sys.stderr, flush=True)
    return 128 - code
