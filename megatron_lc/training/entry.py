"""``run(cfg)``: what ``pretrain_gpt.py`` does after parsing the config; ``errors_said_once`` and ``setup_done``:
how its ranks -- and ``tools/eval_long.py``'s -- say an error.

An error is said once, by construction: every rank fails the same way on a bad config or a missing file, so rank 0
says it and the others stay silent -- but a rank that fails alone (a file missing on one node) must say why. The
ranks agree through the rendezvous store (torchrun's, or ``launcher.py``'s; it outlives every rank): rank 0 prints
its error line and then posts it under ``megatron_lc/outcome/0`` (or posts "" once its setup is done); another
rank that fails reads rank 0's outcome and prints its own line only if it differs. No rank waits on a clock to
decide; a rank waits for rank 0's outcome up to ``parallel.distributed_timeout_minutes`` (rank 0 stuck in a
collective with the failed rank), then speaks.

    rank 0: error: data file not found: x.bin ...     (printed, then posted)
    rank 1: the same error, reads rank 0's: silent

``run`` also leaves how the run ended in ``checkpoint.save`` (``checkpointing/directory.write_outcome``: finished,
stopped with a checkpoint to resume, or failed with its line) for a job script to decide on a requeue.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import signal
import sys
from typing import Optional

import torch.distributed as dist

from ..config import Config, ConfigError
from ..data import DataError
from ..data.demo import prepare_demo_data
from .errors import TrainingError
from .faults import ignore_stop_signals
from .loop import Trainer, TrainState
from .process_group import init_distributed, shutdown
from .checkpointing.directory import OUTCOME, clear_outcome, iter_dir, write_outcome
from .checkpointing.lock import lock_save_dir

log = logging.getLogger("megatron_lc")

STORE_OUTCOME = "megatron_lc/outcome/0"  # the store key of the first error (rank 0's line)


def prepare_data(cfg: Config, rank: int) -> None:
    """Build the demo corpus and its tokenizer when the config asks for the demo and they are missing (rank 0
    builds, others wait). Only the demo's own paths (``config.data.demo_files``) are ever written."""
    d = cfg.data
    if not d.prepare_demo_data or d.mock_data:
        return
    if rank == 0:
        prepare_demo_data(*d.files(cfg.model.vocab_size), cfg.model.vocab_size)
    if dist.is_initialized():
        dist.barrier()


def _store() -> Optional[dist.Store]:
    if dist.is_initialized() and dist.get_world_size() > 1:
        return dist.distributed_c10d._get_default_store()
    return None


def say_once(e: Exception, rank: int, cfg: Config) -> None:
    """Print ``e``'s one line if this rank is the one to say it (see module doc); marks ``e.said``."""
    store = _store()
    if rank == 0 or store is None:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if store is not None:
            store.set(STORE_OUTCOME, str(e))
    else:
        try:
            store.wait([STORE_OUTCOME], datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
            same = store.get(STORE_OUTCOME).decode() == str(e)
        except (RuntimeError, dist.DistError):  # rank 0 never answered, or its store is gone
            same = False
        if not same:
            print(f"[rank {rank}] error: {e}", file=sys.stderr, flush=True)
    e.said = True


def setup_done(rank: int) -> None:
    """Rank 0 is set up: an error from now on is each rank's own (posted as an empty outcome)."""
    if rank == 0 and _store() is not None:
        _store().set(STORE_OUTCOME, "")


@contextlib.contextmanager
def errors_said_once(cfg: Config, rank: int):
    """Around a rank's work once the process group exists: a ``ConfigError`` / ``DataError`` is said once
    (``say_once``) and re-raised; anything else on rank 0 is posted by name, so no rank waits for its outcome."""
    try:
        yield
    except (ConfigError, DataError) as e:
        say_once(e, rank, cfg)
        raise
    except BaseException as e:
        if rank == 0 and _store() is not None:
            _store().set(STORE_OUTCOME, f"{type(e).__name__}")
        raise


def outcome(cfg: Config, state: TrainState) -> tuple[str, str]:
    """(``finished`` or ``stopped``, the detail) of a run whose training returned: its checkpoint is written."""
    iters, checkpoint = cfg.train.train_iters, iter_dir(cfg.checkpoint.save, state.iteration)
    if state.iteration >= iters:
        return "finished", f"iteration {state.iteration} of train.train_iters={iters}, checkpoint {checkpoint}"
    return "stopped", (f"{state.stop_reason or 'stopped'} after step {state.iteration} of train.train_iters={iters}, "
                       f"checkpoint {checkpoint}: resuming from it goes on")


def run(cfg: Config) -> TrainState:
    layout, topo, device = init_distributed(cfg)
    lock, late = None, {}
    try:
        with errors_said_once(cfg, topo.rank):
            lock = lock_save_dir(cfg.checkpoint.save, topo.rank)  # one run per save directory, for the run's life
            if lock is not None:
                clear_outcome(cfg.checkpoint.save)  # the previous run's: this one's is written at its end
            log.info("%s | layout tp=%d cp=%d (ring %d x ulysses %d, %s) dp=%d | model %.2fM params",
                     topo.describe(), topo.tp, topo.cp, topo.ring, topo.ulysses, cfg.parallel.cp_comm_type, topo.dp,
                     cfg.model.num_parameters() / 1e6)
            prepare_data(cfg, topo.rank)
            trainer = Trainer(cfg, topo, device, layout)
            setup_done(topo.rank)
            try:
                state = trainer.train()
            except TrainingError as e:  # a failed save, divergence, a lost rank: no requeue will help
                if lock is not None:
                    with contextlib.suppress(OSError):
                        write_outcome(cfg.checkpoint.save, "failed", str(e))
                raise
            late = ignore_stop_signals(topo.rank)  # from here a SIGUSR1 or SIGTERM must not kill a finished rank
            if lock is not None:  # every rank has returned from the last save (it ends in a barrier)
                try:
                    write_outcome(cfg.checkpoint.save, *outcome(cfg, state))
                except OSError as e:
                    log.warning("could not write %s (%s): a job script cannot tell how this run ended",
                                os.path.join(cfg.checkpoint.save, OUTCOME), e)
            return state
    finally:
        if lock is not None:
            lock.release()
        shutdown()
        for s, handler in late.items():
            signal.signal(s, handler)
