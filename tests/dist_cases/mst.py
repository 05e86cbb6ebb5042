"""Rank functions for tests/memory/mst/test_mst_parallel.py (run under tests.support.dist.run_dist)."""
from megatron_lc.memory.mst import MiniSequenceLMHead, MiniSequenceMLP
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.optimizer import sync_gradients
from tests.support.parity import (assert_close_grads, assert_close_loss, build, full_grads, reference_loss_and_grads,
                          small_config)
from tests.memory.mst.test_mst import _weighted_batch


def mst_tp_parity(rank, world, overrides, weighted=True):
    """tp=world with MsT on vs the single-process unchunked model: loss and every (merged) gradient."""
    cfg = small_config([f"parallel.tensor_model_parallel_size={world}", "memory.mst=true"] + list(overrides))
    batch = _weighted_batch(cfg, weighted=weighted)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    topo = Topology.build(tp=world)
    model = build(cfg, topo)[0]
    assert isinstance(model.layers[0].mlp, MiniSequenceMLP) and isinstance(model.head, MiniSequenceLMHead)
    tok_loss = model(batch["tokens"], batch["position_ids"], batch["labels"])
    loss = (tok_loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    sync_gradients(model, topo)
    assert_close_loss(float(loss), ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return float(loss)
