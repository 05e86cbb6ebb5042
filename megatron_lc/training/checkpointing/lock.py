"""One run per ``checkpoint.save`` directory: ``SaveLock`` holds ``<save>/run.lock`` for the run's life.

    runs/x/run.lock    {"host": "node07", "pid": 41235, "since": "2025-06-01 12:00:03", "job": "81234"}

Rank 0 takes an exclusive ``flock`` on the file (released by the kernel when the process dies, whatever kills it)
and writes who holds it. A second run on the directory fails at start in one line naming the holder's host and
pid. A lock file that names a run but whose ``flock`` is free was left by a run that died: taken over, said in the
log -- when the holder was on this host (its ``flock`` was on this kernel, so it is surely gone) or was an earlier
attempt of the same SLURM job (a requeue). A holder on another host is refused with the file to remove if that
run has ended: a file system's locks may not reach across machines, so its liveness cannot be known from here.
A file system without ``flock`` falls back to the same rules with the holder's pid checked on this host.

The lock is released (the file removed) when the run ends; a directory the lock created is removed again if the
run left nothing in it (a run that failed before its first save leaves no trace).
"""
from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
from typing import Optional

import torch.distributed as dist

from ...config import ConfigError

log = logging.getLogger("megatron_lc")

LOCK = "run.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(fd: int) -> Optional[dict]:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode(errors="replace").strip()
    if not text:
        return None
    try:
        out = json.loads(text)
        return out if isinstance(out, dict) else {"host": "?", "pid": "?"}
    except ValueError:
        return {"host": "?", "pid": "?"}


def _describe(h: dict) -> str:
    return f"host {h.get('host')}, pid {h.get('pid')}" + (f", since {h['since']}" if h.get("since") else "") + (
        f", SLURM job {h['job']}" if h.get("job") else "")


class SaveLock:
    """The lock of one ``checkpoint.save`` directory, held by this process (see module doc)."""

    def __init__(self, save: str):
        self.save = save
        self.path = os.path.join(save, LOCK)
        self.fd: Optional[int] = None
        self.made_dir = False

    def acquire(self) -> None:
        """Take the lock or raise ``ConfigError`` naming its holder."""
        self.made_dir = not os.path.isdir(self.save)
        os.makedirs(self.save, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                flock = self._flock(fd)
            except ConfigError:
                os.close(fd)
                raise
            try:  # the file may have been removed by its holder's release between our open and our flock
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        held = _holder(fd)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
              "since": datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")}
        if held is not None:
            try:
                self._take_over(held, me, flock)
            except ConfigError:
                os.close(fd)  # the file is the holder's: left as it is
                raise
        self.fd = fd
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)

    def _flock(self, fd: int) -> bool:
        """flock ``fd`` (True), or False where the file system has no flock; held by another process:
        ``ConfigError``."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            raise ConfigError(f"checkpoint.save ({self.save}) is in use by another run ({_describe(_holder(fd) or {})})"
                              f": wait for it to end, or save this run to another directory") from None
        except OSError as e:
            if e.errno in (errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS):
                return False
            raise

    def _take_over(self, held: dict, me: dict, flock: bool) -> None:
        """A lock file naming a run whose flock is free (or cannot be had): take it over if that run is surely
        gone, else ``ConfigError``."""
        same_host = held.get("host") == me["host"]
        requeue = held.get("job") is not None and held.get("job") == me["job"]
        pid = held.get("pid")
        if same_host and not flock and isinstance(pid, int) and pid != me["pid"] and _alive(pid):
            raise ConfigError(f"checkpoint.save ({self.save}) is in use by another run ({_describe(held)}): wait "
                              f"for it to end, or save this run to another directory")
        if not (same_host or requeue):
            raise ConfigError(f"checkpoint.save ({self.save}) is locked by a run on another machine "
                              f"({_describe(held)}), which cannot be checked from {me['host']}: if that run has ended, "
                              f"remove {self.path}")
        log.warning("checkpoint.save (%s): took over the lock of a run that is no longer running (%s)", self.save,
                    _describe(held))

    def release(self) -> None:
        """Remove the lock file (while still holding it) and let go; remove the directory if the lock made it and
        nothing else was put there."""
        if self.fd is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self.fd)
            self.fd = None
        if self.made_dir:
            try:
                os.rmdir(self.save)
            except OSError:
                pass


def lock_save_dir(save: Optional[str], rank: int) -> Optional[SaveLock]:
    """Rank 0 takes the lock of ``save`` (None: no saving, no lock); every rank raises the same ``ConfigError``
    when it cannot be had. Every rank must call this (after the process group exists)."""
    if not save:
        return None
    lock, problem = None, None
    if rank == 0:
        lock = SaveLock(save)
        try:
            lock.acquire()
        except ConfigError as e:
            problem = str(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        shared = [problem]
        dist.broadcast_object_list(shared, src=0)
        problem = shared[0]
    if problem is not None:
        raise ConfigError(problem)
    return lock
