"""``memory.activation_offload: checkpoints``: each layer's input on the host, the whole layer re-run in backward.

Exactness: the re-run is the same forward on the same (copied) input, so on one CPU process the loss and every
gradient equal the plain model's bit for bit; under FSDP2 and context parallel the reduction order of the layout
differs (measured <= 1e-8 absolute on the grads), asserted at the contract (loss 1e-5 relative, grads 1e-4)."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.memory.checkpoint_offload import CheckpointOffload
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests import dist_cases_fsdp as cases
from tests.dist import run_dist
from tests.parity import assert_close_grads, assert_close_loss

CKPT = ["memory.activation_offload=checkpoints"]


@pytest.fixture(scope="module")
def reference():
    return cases.first_step_grads(0, 1, ["train.micro_batch_size=4"])


def test_one_process_is_bitwise_the_plain_model(reference):
    got = cases.first_step_grads(0, 1, ["train.micro_batch_size=4"] + CKPT)
    assert got["loss"] == reference["loss"]
    for name, g in reference["grads"].items():
        assert torch.equal(got["grads"][name], g), name


def test_ring_cp2_with_fsdp2_and_mst(reference):
    got = run_dist(2, cases.first_step_grads, ["parallel.context_parallel_size=2", "train.micro_batch_size=4",
                                               "memory.mst=true", "parallel.use_torch_fsdp2=true"] + CKPT)[0]
    assert_close_loss(got["loss"], reference["loss"])
    assert_close_grads(got["grads"], reference["grads"])


def test_host_keeps_exactly_the_layer_inputs():
    """The pool holds L x one layer input ([tokens, micro-batch, hidden] fp32); every forward sends exactly that,
    and after the backward every block is back in the pool."""
    cfg = load_config(None, cases.TINY + CKPT + ["train.micro_batch_size=4", "train.train_iters=1",
                                                 "checkpoint.save=null"])
    t = Trainer(cfg, Topology())
    rt: CheckpointOffload = t.ctx.checkpoints
    per_layer = cfg.data.seq_length * 4 * cfg.model.hidden_size * 4
    assert rt.pool.reserved[CheckpointOffload.TAG] == cfg.model.num_layers * per_layer
    t.train()
    assert rt.bytes_to_host == cfg.model.num_layers * per_layer
    assert not rt.host and not rt.fetched and rt.pool.fit.used == 0


def test_refusals_and_host_budget():
    with pytest.raises(ConfigError) as e:
        resolve_layout(load_config(None, cases.TINY + CKPT + ["memory.recompute_granularity=full"]), 1)
    assert "\n" not in str(e.value) and "activation_offload" in str(e.value) and "recompute_granularity" in str(e.value)
    tiny_host = ["memory.host_memory_gb=0.00001", "train.micro_batch_size=4", "checkpoint.save=null"]
    with pytest.raises(ConfigError) as e:  # 10 KiB of host memory: the inputs need 128 KiB
        Trainer(load_config(None, cases.TINY + CKPT + tiny_host), Topology())
    msg = str(e.value)
    assert "\n" not in msg and "checkpoints" in msg and "host pool needs" in msg, msg
