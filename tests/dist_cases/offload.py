"""Helpers and rank functions for the recompute / Memo offload tests (tests/memory/memo/test_offload*.py,
tests/memory/test_recompute.py).

``memo_parity`` builds the model with the memory feature, runs ``iters`` forward/backward passes on the same batch
and checks loss and every gradient against the plain single-process model each time (tolerances:
tests/support/parity.py;
the token split only changes how many rows a GEMM sees and how autograd sums the two halves' gradients, each a
re-association of fp32 sums, ~1e-7 relative)."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.config import resolve_layout
from megatron_lc.parallel.collectives import all_reduce
from megatron_lc.parallel.token_layout import shard_batch
from megatron_lc.parallel.topology import Axis, Topology
from megatron_lc.training.optimizer import sync_gradients
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, full_grads,
                          reference_loss_and_grads, small_config)

GPT = ["model.normalization=LayerNorm", "model.swiglu=false", "model.position_embedding_type=learned_absolute",
       "model.add_bias_linear=true", "model.untie_embeddings_and_output_weights=false",
       "model.max_position_embeddings=64"]


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is faster than two on a shared 2-core machine (no spin-waiting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def memo_overrides(alpha, layers: int = 4) -> list:
    return [f"model.num_layers={layers}", "memory.activation_offload=memo", f"memory.offload_fraction={alpha}"]


def memo_parity(rank, world, overrides, iters: int = 1, tp: int = 1, cp: int = 1):
    """Loss and grads of the model with ``overrides`` equal the plain model's; returns the runtime's stats."""
    cfg = small_config(list(overrides) + [f"parallel.tensor_model_parallel_size={tp}",
                                          f"parallel.context_parallel_size={cp}"])
    layout = resolve_layout(cfg, world)
    batch = batch_for(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    topo = Topology.build(tp=tp, cp=cp, ulysses=cfg.parallel.ulysses_size)
    model, ctx = build(cfg, topo)
    local = shard_batch(batch, layout, topo) if cp > 1 else batch
    for _ in range(iters):
        model.zero_grad(set_to_none=True)
        tok = model(local["tokens"], local["position_ids"], local["labels"])
        loss = (tok * local["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
        if world > 1:
            sync_gradients(model, topo)
            loss = loss.detach().clone()
            all_reduce(loss, topo, Axis.DP_CP)
        assert_close_loss(float(loss), ref_loss)
        assert_close_grads(full_grads(model, topo), ref_grads)
    rt = ctx.memo
    return None if rt is None else {"stats": rt.stats(), "alpha": rt.alpha, "attn_calls": rt.attn_forward_calls}


def memo_parity_cases(rank, world, cases, tp: int = 1, cp: int = 1):
    """Several ``memo_parity`` cases in one spawn (process start-up dominates on CI); failures name the case.
    A case is a list of overrides (run with ``tp``, ``cp``) or a tuple ``(overrides, tp, cp)``."""
    out = []
    for case in cases:
        overrides, tp_, cp_ = case if isinstance(case, tuple) else (case, tp, cp)
        try:
            out.append(memo_parity(rank, world, overrides, 1, tp_, cp_))
        except AssertionError as e:
            raise AssertionError(f"case {overrides} tp={tp_} cp={cp_}: {e}") from None
    return out


def host_budget_agreed(rank, world, readings):
    """``training.setup.check_host_budget`` on this rank with a pool of 30 GiB, ``MemAvailable`` planted per rank
    (``readings[rank]`` GiB, one node, as if a neighbour had pinned before the other read): what each rank said."""
    import importlib

    from megatron_lc.device import HostMemoryError, HostPool
    from megatron_lc.training.setup import check_host_budget
    from megatron_lc.units import GIB

    hb = importlib.import_module("megatron_lc.device.host_budget")  # (the package exports a function of that name)
    hb.available_host_bytes = lambda: readings[rank] * GIB * world
    pool = HostPool()
    pool.reserve("fpdt", 30 * GIB)
    try:
        check_host_budget(pool, None, rank)
    except HostMemoryError as e:
        return str(e)
    return "fits"
