"""``--nproc-per-node N`` of the command-line scripts (``pretrain_gpt.py``, ``tools/eval_long.py``): N ranks on this
node, started, signalled and waited for by this process, after the script has checked its config for them.

    launch_local(2, "pretrain_gpt.py", worker_args(sys.argv[1:]), grace_s=600) -> exit code
    launch_local(8, "pretrain_gpt.py", args, 600, nodes=Nodes(count=4, rank=1, addr="gpu007", port=29500))

What it does (what torchrun's agent does with ``--signals-to-handle`` and a shutdown timeout, but for the end):
- starts the ranks as ``torch.distributed`` workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), each in its
  own session, so a terminal's Ctrl-C reaches this process alone and is forwarded once; the rendezvous store is
  hosted by node 0's launcher (torchrun's "agent store"), so it outlives every rank -- which rank reports an error
  is agreed through it (``training/entry.py``);
- several nodes (``Nodes``; ``scripts/slurm/launch.sh`` runs this once per node): node 0 hosts the store on
  ``addr:port``, the other nodes' launchers join it (waiting up to ``join_timeout_s`` for node 0), every node posts
  its ranks per node and starts its ranks once all have joined (ranks ``node * N .. node * N + N - 1``); at the end
  node 0 waits for the other nodes to finish before its store goes (torchrun's exit barrier);
- forwards SIGTERM, SIGINT and SIGUSR1 to every rank: the ranks finish the step, save and exit 0
  (``training/faults.StopControl``; a second SIGINT stops them at once), and this process waits up to ``grace_s``
  for that save before it kills them (SIGKILL, said in one line);
- when a rank exits with an error, kills the others (a rank that lost a peer can only wait for a timeout) and
  exits with that rank's code; the rank printed its own line, this process adds nothing (no launcher traceback);
  a rank killed by a signal is one line here (exit 128 + the signal);
- ranks follow this process: each asks the kernel for SIGTERM when it dies (``follow_launcher``), so even a
  SIGKILL of this process leaves no rank behind, and the SIGTERM makes them save first.

Why not torchrun (it was, before, in-process and per node under SLURM): on a forwarded signal its agent raises
``SignalException`` (a 40-line traceback and exit 1 however the workers ended), and it does not report the workers'
exit codes; under ``srun --kill-on-bad-exit`` that exit 1 ends the other nodes while they save.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from ..config import ConfigError

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAUNCHER_PID = "MEGATRON_LC_LAUNCHER_PID"
# the launcher's arguments, not the ranks'
OWN_FLAGS = ("--nproc-per-node", "--shutdown-grace", "--nnodes", "--node-rank", "--master-addr", "--master-port")
NODES_KEY = "megatron_lc/launcher"  # the launchers' keys in the store (the ranks' are under /worker/attempt_0)
DEFAULT_PORT = 29500  # torchrun's


@dataclass(frozen=True)
class Nodes:
    """The nodes of one run and this node's place among them: ``count`` nodes, this one ``rank``; node 0 hosts the
    rendezvous store on ``port`` (0: any free one, a single node only) and the others reach it at ``addr``.

    >>> Nodes(count=4, rank=1, addr="gpu007", port=29500).ranks(8)
    range(8, 16)
    """

    count: int = 1
    rank: int = 0
    addr: str = "127.0.0.1"
    port: int = 0
    join_timeout_s: float = 600.0  # how long a node waits for the others to join (torchrun's join timeout)

    def __post_init__(self):
        if self.count < 1:
            raise ConfigError(f"--nnodes must be at least 1, not {self.count}")
        if not 0 <= self.rank < self.count:
            raise ConfigError(f"--node-rank must be in 0..{self.count - 1} for --nnodes {self.count}, not {self.rank}")
        if not 0 <= self.port < 65536 or (self.count > 1 and self.port == 0):
            raise ConfigError(f"--master-port must be a port number (1..65535) for several nodes, not {self.port}")

    def ranks(self, nproc: int) -> range:
        """The global ranks of this node's ``nproc`` ranks."""
        return range(self.rank * nproc, (self.rank + 1) * nproc)

    def where(self) -> str:
        return f"{self.addr}:{self.port}"


class LaunchError(Exception):
    """The nodes could not meet; the message is one line, ``code`` the exit code to end with."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


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


def _env(local: int, nproc: int, nodes: Nodes, port: int) -> dict:
    rank = nodes.ranks(nproc)[local]
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(nodes.count * nproc),
               LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK=str(nodes.rank), GROUP_WORLD_SIZE=str(nodes.count),
               ROLE_RANK=str(rank), MASTER_ADDR=nodes.addr, MASTER_PORT=str(port),
               TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    env[LAUNCHER_PID] = str(os.getpid())  # threads: each rank's own choice (process_group.set_threads)
    return env


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _store(nodes: Nodes, ranks: "_Ranks") -> dist.TCPStore:
    """Node 0: the rendezvous store, hosted here; another node: a client of node 0's, once it is up (polled with
    plain connections: torch's client logs a C++ stack for every attempt that times out)."""
    if nodes.rank == 0:
        try:
            return dist.TCPStore(nodes.addr, nodes.port, nodes.count, is_master=True, wait_for_workers=False)
        except (RuntimeError, dist.DistError) as e:
            raise LaunchError(f"node 0 could not host the rendezvous store on port {nodes.port} "
                              f"({_first_line(e)}): another process on this host may hold it; pick another port "
                              f"(--master-port, MASTER_PORT of scripts/slurm/launch.sh)", 3) from None
    deadline = time.monotonic() + nodes.join_timeout_s
    while True:
        try:
            socket.create_connection((nodes.addr, nodes.port), timeout=5).close()
            break
        except OSError as e:
            _check_stop(ranks, "node 0's rendezvous store was up")
            if time.monotonic() > deadline:
                raise LaunchError(f"node {nodes.rank} could not reach the rendezvous store of node 0 at "
                                  f"{nodes.where()} within {nodes.join_timeout_s:g} s ({e.strerror or e}): is node 0 "
                                  f"running, and is {nodes.addr} the address this node reaches it at?", 3) from None
            time.sleep(0.2)
    return dist.TCPStore(nodes.addr, nodes.port, nodes.count, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=nodes.join_timeout_s))


def _check_stop(ranks: "_Ranks", before: str) -> None:
    """A stop signal while the nodes meet: end, no rank started."""
    if ranks.stop_signal is not None:
        raise LaunchError(f"{signal.Signals(ranks.stop_signal).name} before {before}: stopped without starting the "
                          f"ranks", 128 + ranks.stop_signal)


def _join(store: dist.Store, nodes: Nodes, nproc: int, ranks: "_Ranks") -> None:
    """Post this node's ranks per node, wait until every node has (polling: a stop signal ends the wait) and check
    that they agree."""
    if nodes.count == 1:
        return
    keys = [f"{NODES_KEY}/nproc/{n}" for n in range(nodes.count)]
    store.set(keys[nodes.rank], str(nproc))
    deadline = time.monotonic() + nodes.join_timeout_s
    while not store.check(keys):
        _check_stop(ranks, "every node had joined")
        if time.monotonic() > deadline:
            missing = [n for n, k in enumerate(keys) if not store.check([k])]
            raise LaunchError(f"node(s) {', '.join(map(str, missing))} of {nodes.count} did not join the rendezvous "
                              f"at {nodes.where()} within {nodes.join_timeout_s:g} s", 3)
        time.sleep(0.05)
    counts = [int(store.get(k)) for k in keys]
    if len(set(counts)) > 1:
        raise LaunchError(f"the nodes run different numbers of ranks (node: ranks {dict(enumerate(counts))}); every "
                          f"node must have the same --nproc-per-node", 2)


def _leave(store: dist.Store, nodes: Nodes, code: int, wait_s: float) -> None:
    """Say this node is done. Node 0, when its ranks ended well, then waits up to ``wait_s`` for the other nodes:
    their ranks may still use its store while they end (an error agreed through it, the process group's shutdown)."""
    if nodes.count == 1:
        return
    keys = [f"{NODES_KEY}/done/{n}" for n in range(nodes.count)]
    try:
        store.set(keys[nodes.rank], str(code))
    except (RuntimeError, dist.DistError):  # node 0 is gone (it failed): nothing to tell it
        return
    if nodes.rank != 0 or code != 0:
        return
    deadline = time.monotonic() + wait_s
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [n for n, k in enumerate(keys) if not store.check([k])]
            print(f"node(s) {', '.join(map(str, missing))} had not ended {wait_s:g} s after the ranks of node 0; "
                  f"node 0 ends (its rendezvous store with it)", file=sys.stderr, flush=True)
            return
        time.sleep(0.05)


def launch_local(nproc: int, script: str, args: list[str], grace_s: float, saves: bool = True,
                 nodes: Nodes = Nodes()) -> int:
    """Run ``python script args`` as this node's ``nproc`` ranks (see module doc); returns the exit code to end
    with. ``saves``: the ranks stop on a forwarded signal by saving (``pretrain_gpt.py``); ``tools/eval_long.py``'s
    ranks have nothing to save and a forwarded SIGTERM ends them. ``nodes``: one node unless told otherwise."""
    ranks = _Ranks([])
    previous = {s: signal.signal(s, ranks.forward) for s in FORWARDED}  # before any rank exists: none is missed
    try:
        try:
            store = _store(nodes, ranks)
            _join(store, nodes, nproc, ranks)
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return e.code
        except (RuntimeError, dist.DistError) as e:  # node 0's store went away while the nodes met
            print(f"error: node {nodes.rank} lost the rendezvous store of node 0 at {nodes.where()} while the nodes "
                  f"joined ({_first_line(e)})", file=sys.stderr, flush=True)
            return 3
        if nodes.count > 1:
            span = nodes.ranks(nproc)
            print(f"node {nodes.rank} of {nodes.count}: ranks {span[0]}..{span[-1]} of {nodes.count * nproc}, "
                  f"rendezvous store {'hosted here' if nodes.rank == 0 else 'of node 0'} at {nodes.where()}",
                  file=sys.stderr, flush=True)
        for r in range(nproc):
            ranks.procs.append(subprocess.Popen([sys.executable, script, *args], env=_env(r, nproc, nodes, store.port),
                                                start_new_session=True))
        code = _wait(ranks, grace_s, saves)
        _leave(store, nodes, code, grace_s)
        return code
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
