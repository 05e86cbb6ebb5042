"""Multi-rank cases for tests/training/test_faults_nonfinite.py and tests/data/test_data_resume.py (run by
tests.support.dist.run_dist)."""
from __future__ import annotations

import math

import torch


def _trainer(overrides):
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer
    from tests.support.parity import small_config

    cfg = small_config(list(overrides))
    topo = Topology.build(tp=cfg.parallel.tensor_model_parallel_size, cp=cfg.parallel.context_parallel_size)
    return Trainer(cfg, topo)


def nonfinite_on_one_rank(rank, world, overrides, bad_steps, bad_rank):
    """Rank ``bad_rank`` alone sees a non-finite grad norm at ``bad_steps`` (after the grad sync, so the other
    ranks' own values are finite). Returns (per-step skipped flags, final params, error message or None)."""
    from megatron_lc.training import loop
    from megatron_lc.training.errors import NonFiniteError

    original = loop.clip_grad_norm
    trainer = _trainer(overrides)

    def clip(model, max_norm, topo):
        norm = original(model, max_norm, topo)
        return math.nan if rank == bad_rank and trainer.state.iteration + 1 in bad_steps else norm

    loop.clip_grad_norm = clip
    skipped, error = [], None
    original_step = trainer.train_step

    def step(i):
        rec = original_step(i)
        skipped.append(rec["skipped"])
        return rec

    trainer.train_step = step
    try:
        trainer.train()
    except NonFiniteError as e:
        error = str(e)
    finally:
        loop.clip_grad_norm = original
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return skipped, params, error


def record_sample_ids(rank, world, overrides):
    """Train; return the global sample ids every step read on this rank (test hook on the trainer's
    ``microbatches``, which the loop calls once per step)."""
    trainer = _trainer(overrides)
    seen = []
    original = trainer.microbatches

    def microbatches(consumed):
        batches = original(consumed)
        seen.append(sorted(int(i) for b in batches for i in b["sample_ids"]))
        return batches

    trainer.microbatches = microbatches
    state = trainer.train()
    return seen, state.consumed_samples, state.losses
