"""Rank functions for tests/parallel/test_tensor_parallel.py (run under tests.support.dist.run_dist)."""
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.optimizer import sync_gradients
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, full_grads,
                                  reference_loss_and_grads, small_config)


def tp_parity(rank, world, overrides):
    cfg = small_config([f"parallel.tensor_model_parallel_size={world}"] + list(overrides))
    batch = batch_for(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    topo = Topology.build(tp=world)
    model = build(cfg, topo)[0]
    tok_loss = model(batch["tokens"], batch["position_ids"], batch["labels"])
    loss = (tok_loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    sync_gradients(model, topo)
    assert_close_loss(float(loss), ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return float(loss)
