"""A training save (``save_checkpoint``, every rank calls it; the directory's layout: ``checkpoint.py``), in three
phases that ``async_checkpoint.py`` shares: ``begin_save`` (the state checked, ``iter_N.tmp`` made), the write of
the state (DCP's, here or in the background), ``finish_save`` (RNG files, checksums, ``meta.json``, the rename).

What a save never does:
    write a state that is not finite -- every tensor it would write (weights, AdamW moments and steps, each rank
    its own pieces) is checked first, one sum per tensor (an exact ``isfinite`` only where a sum is not finite),
    and a non-finite state stops the run (``NonFiniteStateError``, exit 3) with the newest checkpoint untouched;
    fail on one rank alone -- each phase (prepare the directory, DCP's write, the RNG files, the rename) ends with
    the ranks agreeing, so a failure anywhere is the same one-line ``CheckpointWriteError`` on every rank, naming
    the path and the cause the operating system gives ("No space left on device", "File too large", "Permission
    denied"), the partial ``iter_N.tmp`` removed and the previous checkpoint kept;
    prune a checkpoint for one saved in a run of skipped steps (``checkpoint_dir.prune``: only checkpoints saved
    after a step that updated the weights count toward ``checkpoint.keep_last``).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import resource
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from ...config import Config
from ...device import has_values
from ...parallel.topology import Topology
from . import sharded_state
from ...parallel.collectives import all_gather_objects
from .common import FORMAT_VERSION, barrier, file_checksums, leads, uses_zero
from .data_only import rng_state
from .directory import (LATEST, atomic_torch_save, atomic_write_text, iter_dir, newest_good_checkpoint, prune,
                        remove_leftovers)
from ..errors import TrainingError
from .sharded_state import ShardedState

log = logging.getLogger("megatron_lc")


class CheckpointWriteError(TrainingError):
    """A save failed on some rank; the message names the path and the cause (the previous checkpoint stays)."""


class NonFiniteStateError(TrainingError):
    """The state to save holds inf or nan: nothing is written."""


def first_non_finite(tensors: dict) -> Optional[str]:
    """The first key of ``{key: tensor}`` whose (local) tensor holds inf or nan, or None. One sum per tensor,
    stacked per device (AdamW's ``step`` counts stay on the host beside the device's weights and moments, and a
    stack of two devices raises on CUDA) and read once per device; a sum can overflow where every element is
    finite, so those are checked element-wise. Example: weights and moments on ``cuda:0``, steps on the CPU: two
    stacks, two reads. A rehearsal's fake tensors have no value to read: None."""
    local = {k: (t.to_local() if isinstance(t, DTensor) else t) for k, t in tensors.items()}
    local = {k: t for k, t in local.items() if t.numel()}
    by_device: dict = {}
    for k, t in local.items():
        by_device.setdefault(t.device, []).append(k)
    suspects = set()
    for keys in by_device.values():
        sums = torch.stack([local[k].sum(dtype=torch.float32) for k in keys])
        if has_values(sums):
            suspects.update(k for k, ok in zip(keys, torch.isfinite(sums).tolist()) if not ok)
    return next((k for k in local if k in suspects and not bool(torch.isfinite(local[k]).all())), None)


def _os_error(e: BaseException) -> Optional[OSError]:
    """The first ``OSError`` in ``e``'s chain (DCP's ``CheckpointException`` unwrapped), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        if isinstance(e, CheckpointException) and e.failures:
            e = e.failures[min(e.failures)][0]
        else:
            e = e.__cause__ or e.__context__
    return None


def _probe(directory: str) -> Optional[OSError]:
    """Write 1 MiB into ``directory`` and remove it: the OS's own reason when writing there fails, or None."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".write_probe")
    except OSError as e:
        return e
    try:
        os.write(fd, b"\0" * (1 << 20))
        os.fsync(fd)
        return None
    except OSError as e:
        return e
    finally:
        os.close(fd)
        os.unlink(name)


def write_failure_cause(e: BaseException, directory: str) -> tuple[str, bool]:
    """(why a write into ``directory`` failed, in a few words; whether the OS said it). torch's file writer hides
    the OS error of a full disk (it says ``unexpected pos 704 vs 598``), so without an ``OSError`` in the chain the
    directory is probed."""
    found = _os_error(e) or (_probe(directory) if os.path.isdir(directory) else None)
    if found is None:
        text = str(e).strip().splitlines()
        free = shutil.disk_usage(directory).free if os.path.isdir(directory) else None
        return f"{type(e).__name__}: {text[-1][:160] if text else ''}" + (
            f" ({free} bytes free there)" if free is not None else ""), False
    why = found.strerror or str(found)
    if found.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            why += f" (this process may write files of at most {limit} bytes: ulimit -f)"
    return f"{found.filename or directory}: {why}", True


def together(topo: Topology, final: str, tmp: str, step: Callable[[], None]) -> None:
    """Run this rank's part of a save phase; if it failed on any rank, every rank raises the same
    ``CheckpointWriteError`` (rank 0 removes the partial directory first). The cause shown is the one the OS gave
    on the rank where it happened (lowest such rank), named with that rank."""
    problem = None
    try:
        step()
    except (OSError, RuntimeError, CheckpointException) as e:
        text, certain = write_failure_cause(e, tmp if os.path.isdir(tmp) else os.path.dirname(tmp))
        origin = getattr(e, "failed_rank", None)  # DCP hands every rank the error of the rank it happened on
        origin = topo.rank if origin is None else origin
        priority = 0 if certain and origin == topo.rank else 1 if certain else 2  # its own rank's OS error first
        problem = (priority, f"rank {origin}: {text}" if topo.world_size > 1 else text)
    problems = [p for p in all_gather_objects(problem) if p is not None]
    if problems:
        if leads(topo):
            shutil.rmtree(tmp, ignore_errors=True)
        kept = newest_good_checkpoint(os.path.dirname(final)) or "none yet"
        raise CheckpointWriteError(f"could not write checkpoint {final} ({min(problems)[1]}); the previous "
                                   f"checkpoint is kept: {kept}")


@dataclass
class SaveJob:
    """A save begun (``begin_save``) and not yet finished: what its later phases need."""

    final: str  # iter_N
    tmp: str  # iter_N.tmp, written into
    iteration: int
    tensors: dict  # this rank's DCP state (weights, AdamW states), checked finite
    has_optim: bool  # this rank's state holds AdamW states
    rng: dict  # this rank's RNG states when the save began (training may go on while the state is written)


def save_checkpoint(cfg: Config, topo: Topology, model, opt, iteration: int, consumed_samples: int,
                    extra: Optional[dict] = None) -> str:
    """Write the checkpoint of ``iteration`` atomically; every rank must call this. Returns its directory.
    ``extra``: more ``meta.json`` fields (the skip counts: ``skipped_in_a_row`` decides pruning).
    ``async_checkpoint.py`` runs the same phases with the state written in the background."""
    job = begin_save(cfg, topo, model, opt, iteration)
    together(topo, job.final, job.tmp, lambda: sharded_state.write(job.tmp, job.tensors))
    return finish_save(cfg, topo, opt, job, consumed_samples, extra)


def begin_save(cfg: Config, topo: Topology, model, opt, iteration: int) -> SaveJob:
    """The state of ``iteration`` checked finite on every rank (``NonFiniteStateError``: nothing written), a fresh
    ``iter_N.tmp`` (leftovers of unfinished saves removed) and this rank's RNG states. Every rank calls it."""
    save = cfg.checkpoint.save
    final = iter_dir(save, iteration)
    tmp = final + ".tmp"
    state = ShardedState(model, topo)
    optim = state.optimizer_state(opt)
    tensors = {**state.model_state(), **optim}
    bad = [f"rank {r}: {k}" for r, k in enumerate(all_gather_objects(first_non_finite(tensors))) if k is not None]
    if bad:
        raise NonFiniteStateError(
            f"not saving iteration {iteration}: the state is not finite ({bad[0]}); the newest checkpoint is kept: "
            f"{newest_good_checkpoint(save) or 'none yet'}. Resume from it with a lower train.lr or more warmup")

    def prepare():
        if leads(topo):
            os.makedirs(save, exist_ok=True)
            for left in remove_leftovers(save):
                log.info("removed %s: a save that did not finish", left)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    together(topo, final, tmp, prepare)
    return SaveJob(final, tmp, iteration, tensors, bool(optim), rng_state())


def finish_save(cfg: Config, topo: Topology, opt, job: SaveJob, consumed_samples: int,
                extra: Optional[dict] = None) -> str:
    """After every rank has written its state into ``job.tmp``: the RNG files, checksums, ``meta.json``, the rename
    to ``iter_N``, ``latest_checkpointed_iteration.txt``, pruning. Every rank calls it; returns ``job.final``."""
    save, final, tmp = cfg.checkpoint.save, job.final, job.tmp
    together(topo, final, tmp, lambda: atomic_torch_save(job.rng, os.path.join(tmp, f"rng_rank{topo.rank:05d}.pt")))
    files = {}
    for share in all_gather_objects(file_checksums(tmp, topo)):
        files.update(share)
    has_optim = any(all_gather_objects(job.has_optim))  # no AdamW state before the first step (or every step skipped)

    def publish():
        if not leads(topo):
            return
        meta = {"format_version": FORMAT_VERSION, "iteration": job.iteration, "consumed_samples": consumed_samples,
                "world_size": topo.world_size, "tp": topo.tp, "cp": topo.cp, "dp": topo.dp,
                "zero": uses_zero(opt), "optimizer": has_optim, "config": cfg.to_dict(), "files": files,
                **(extra or {})}
        atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        if os.path.isdir(final):  # re-saving the same iteration: move the old one aside first
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        atomic_write_text(os.path.join(save, LATEST), str(job.iteration))

    together(topo, final, tmp, publish)
    if leads(topo):
        prune(save, cfg.checkpoint.keep_last)
    barrier(topo)  # every rank returns once the checkpoint is complete and pruned
    return final
