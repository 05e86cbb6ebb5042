"""Faults a week-long run must survive: preemption signals, a time limit, non-finite steps, stuck collectives.

Stopping (``StopControl``):
    SIGTERM, SIGUSR1 (SLURM preemption, ``--signal=USR1@300`` before the time limit, a launcher forwarding them)
    and SIGINT (Ctrl-C) only set a flag; nothing else is done inside the handler -- except for a second SIGINT,
    which stops the process at once without saving (rank 0 says so in one line; exit 130). Ranks receive a signal at different moments (or only one
    rank receives it), so once per step every rank all-reduces (MAX, world group) a small vector
    ``[signal number, time limit reached, step non-finite]``. Every rank therefore sees the same vector after the
    same step: all stop together, save one checkpoint together and exit 0. Example, 4 ranks, SIGUSR1 reaches rank 2
    during step 7: after step 7's all-reduce every rank reads ``[10, 0, 0]``, finishes step 7, saves iter 7, exits.
    After the last step a stop signal changes nothing (``ignore_stop_signals``): the process is ending, and by their
    default action SIGUSR1 and SIGTERM would kill it on the way out of a run that finished well.

Non-finite steps (``SkipCounter``):
    a step whose global loss or grad norm is inf/nan on *any* rank is skipped by all (no optimizer update; its
    samples count as consumed, its learning-rate step too), reported in the log and in ``metrics.jsonl``
    (``"skipped": true``); ``train.max_consecutive_skipped_steps`` skipped steps in a row raise ``NonFiniteError``.
    A global batch with no trained token (conversations' prompts only: ``"tokens": 0``) has a NaN loss and is
    skipped and counted the same way, its log line saying why.

Collectives (``collective_errors``):
    gloo raises once a collective has waited ``parallel.distributed_timeout_minutes`` (the process groups of
    ``Topology.build`` get that timeout too), or when a peer's connection drops; that error becomes a one-line
    ``CollectiveTimeoutError`` / ``PeerLostError`` naming the rank, the step and the key. NCCL's watchdog aborts
    the process after the same timeout instead of raising (never executed here: no GPU).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config import Config
from .errors import CollectiveTimeoutError, NonFiniteError, PeerLostError, TrainingError

log = logging.getLogger("megatron_lc")

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopControl:
    """Signal flag + time limit + per-step agreement over all ranks."""

    def __init__(self, cfg: Config):
        self.enabled = cfg.train.exit_signal_handler
        self.exit_seconds = (cfg.train.exit_duration_in_mins * 60.0 if cfg.train.exit_duration_in_mins else None)
        self.start = time.monotonic()
        self.received = 0  # signal number, 0 = none
        self.interrupts = 0  # SIGINTs seen
        self.rank = 0
        self._previous: dict = {}

    def install(self) -> None:
        """Route SIGTERM/SIGUSR1/SIGINT to the flag (main thread only; elsewhere signals keep their default
        action)."""
        if not self.enabled:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("not in the main thread: SIGTERM/SIGUSR1/SIGINT will not trigger a checkpoint")
            return
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        for sig in EXIT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # keep it minimal: runs between two bytecodes of the main thread
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts >= 2:  # the user insists: no step, no save, no cleanup (saves are atomic)
                if self.rank == 0:
                    os.write(2, b"error: interrupted again (Ctrl-C twice): stopped at once, without saving\n")
                os._exit(130)
            if self.rank == 0:
                os.write(2, b"received SIGINT: finishing this step and saving a checkpoint (Ctrl-C again stops at "
                            b"once, without saving)\n")
        self.received = self.received or signum

    def agree(self, nonfinite: bool) -> tuple[int, bool, bool]:
        """All-reduce (MAX) ``[signal, time up, nonfinite]`` over the world; every rank gets the same answer."""
        time_up = self.exit_seconds is not None and time.monotonic() - self.start >= self.exit_seconds
        flags = torch.tensor([self.received, int(time_up), int(nonfinite)], dtype=torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        sig, up, bad = (int(x) for x in flags)
        return sig, bool(up), bool(bad)

    @staticmethod
    def reason(sig: int, time_up: bool) -> Optional[str]:
        if sig:
            return f"received {signal.Signals(sig).name}"
        if time_up:
            return "train.exit_duration_in_mins reached"
        return None


def ignore_stop_signals(rank: int) -> dict:
    """From now on SIGTERM, SIGUSR1 and SIGINT are said (rank 0) and ignored: training has returned, its last save
    done, nothing is left to stop. Returns the handlers replaced, for ``signal.signal`` to put back (none outside the main thread, where
    signals cannot be handled)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    said = {s: f"received {s.name} after the last step: nothing to stop, the run is ending\n".encode()
            for s in EXIT_SIGNALS}

    def noted(signum, frame) -> None:
        if rank == 0:
            os.write(2, said[signum])

    return {s: signal.signal(s, noted) for s in EXIT_SIGNALS}


class SkipCounter:
    """Counts non-finite steps in a row; raises ``NonFiniteError`` at ``train.max_consecutive_skipped_steps``.
    The counts are saved in every checkpoint's meta.json (``meta()``) and go on from there on resume
    (``resumed``: the loaded meta), so resuming in the middle of a run of skipped steps does not reset it."""

    def __init__(self, cfg: Config, resumed: Optional[dict] = None):
        self.limit = cfg.train.max_consecutive_skipped_steps
        self.in_a_row = int((resumed or {}).get("skipped_in_a_row", 0))
        self.total = int((resumed or {}).get("skipped_steps", 0))
        self.empty_in_a_row = 0  # of those in a row, the ones without a trained token

    def meta(self) -> dict:
        return {"skipped_in_a_row": self.in_a_row, "skipped_steps": self.total}

    def update(self, step: int, skipped: bool, loss: float, grad_norm: float, tokens: Optional[int] = None) -> None:
        """``tokens``: the step's global count of tokens in the loss (0: none was trained -- a global batch of
        conversations' prompts only -- which is skipped and counted as a non-finite step)."""
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.total += 1
        empty = tokens == 0
        self.empty_in_a_row = self.empty_in_a_row + 1 if empty else 0
        why = ("no token of the global batch is trained (its loss mask is all zero: conversations' prompts only)"
               if empty else f"non-finite loss or grad norm on at least one rank (this rank: loss {loss}, grad norm "
               f"{grad_norm})")
        log.warning("step %d skipped: %s; %d in a row, stop at %d", step, why, self.in_a_row, self.limit)
        if self.in_a_row >= self.limit:
            if self.empty_in_a_row == self.in_a_row:
                raise NonFiniteError(f"{self.in_a_row} global batches in a row (up to step {step}) had no trained "
                                     f"token; stopping (train.max_consecutive_skipped_steps={self.limit}). The "
                                     f"conversations' loss masks train too few tokens: check the data")
            raise NonFiniteError(f"{self.in_a_row} steps in a row (up to step {step}) had a non-finite loss or grad "
                                 f"norm; stopping (train.max_consecutive_skipped_steps={self.limit}). Resume from "
                                 f"the last checkpoint with a lower train.lr or more warmup")


_BACKEND = re.compile(r"gloo|nccl|c10d|ProcessGroup", re.IGNORECASE)  # errors raised by the comm backend
_TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)


@contextlib.contextmanager
def collective_errors(cfg: Config, rank: int, what: str):
    """Turn a communication failure raised by the backend inside the block into a one-line ``TrainingError``."""
    try:
        yield
    except TrainingError:
        raise
    except RuntimeError as e:  # torch's DistBackendError / gloo errors are RuntimeErrors
        if not (_BACKEND.search(str(e)) or isinstance(e, dist.DistError)):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # drop the "[.../gloo/...cc:78]" source location
        minutes = cfg.parallel.distributed_timeout_minutes
        if _TIMEOUT.search(str(e)):
            raise CollectiveTimeoutError(
                f"rank {rank}: a collective did not complete within parallel.distributed_timeout_minutes="
                f"{minutes:g} ({minutes * 60:.0f} s) during {what}; another rank is stuck or died, see its log "
                f"({first})") from None
        if _PEER.search(str(e)):
            raise PeerLostError(f"rank {rank}: lost the connection to another rank during {what}; that rank "
                                f"probably died, see its log ({first[:200]})") from None
        raise


_HOST_OOM = re.compile(r"DefaultCPUAllocator: can't allocate memory: you tried to allocate (\d+) bytes")


def out_of_host_memory(e: BaseException) -> Optional[str]:
    """The one line for a failed host allocation (torch's ``DefaultCPUAllocator`` error or ``MemoryError``), or
    None for any other error."""
    if isinstance(e, MemoryError):
        asked = ""
    else:
        m = _HOST_OOM.search(str(e))
        if m is None:
            return None
        asked = f": an allocation of {int(m.group(1))} bytes ({int(m.group(1)) / 2**30:.1f} GiB) failed"
    return (f"out of host memory{asked}; pick a layout that needs less (more tp or cp, activation offload off, a "
            f"smaller micro_batch_size): python tools/estimate.py --config CONFIG --hardware HW --auto lists layouts "
            f"with their host memory")

