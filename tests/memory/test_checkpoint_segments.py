"""Segment checkpoints (``memory.checkpoint_every: k``) and FPDT's block inside the checkpoints mode's chunked layer.

Segments: only every k-th layer's input is on the host; a segment's top layer re-makes the inputs of the layers below
it from the checkpoint with the same no-graph forward the step ran, so on one process the re-made inputs, the loss
and every gradient are the plain model's bit for bit (unchunked). With ``layer_chunk_size`` only the GEMM blocking of
the chunks moves the last bits (measured <= 2.1e-8 absolute on the grads, loss equal); under FSDP2 / context
parallel the layout's reduction order differs (measured <= 1e-8 absolute) -- asserted at the contract (loss 1e-5
relative, grads 1e-4 of each gradient's largest entry).

FPDT in the chunked layer: the block's chunked online softmax re-associates fp32 sums (measured: loss equal on one
process, 4.3e-8 relative at cp 2; grads <= 1.1e-6 of their largest entry, as FPDT's own block unchunked) -- asserted
at the contract.
"""
from __future__ import annotations

import pytest
import torch

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.memory.checkpoint_offload import CheckpointOffload
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import fsdp as cases
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads, assert_close_loss

FIVE = ["model.num_layers=5", "train.micro_batch_size=4"]
CKPT = ["memory.activation_offload=checkpoints"]
FPDT = ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=16"]

# every layout of the list, one spawn of 2 ranks for all of them
DIST = {
    "k2-ring-fsdp2-mst-chunks": ["parallel.context_parallel_size=2", "parallel.use_torch_fsdp2=true", "memory.mst=true",
                                 "memory.checkpoint_every=2", "memory.layer_chunk_size=10"],
    "k3-ulysses": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a", "memory.checkpoint_every=3"],
    "k2-tp2-sp-chunks": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                         "memory.checkpoint_every=2", "memory.layer_chunk_size=10"],
    "k3-fpdt-cp2": ["parallel.context_parallel_size=2", "memory.checkpoint_every=3"] + FPDT,
    "fpdt-cp2-chunked": ["parallel.context_parallel_size=2", "memory.layer_chunk_size=5"] + FPDT,
    "k2-fpdt-cp2-chunked-fsdp2": ["parallel.context_parallel_size=2", "memory.layer_chunk_size=5",
                                  "memory.checkpoint_every=2", "parallel.use_torch_fsdp2=true"] + FPDT,
}


@pytest.fixture(scope="module")
def reference():
    return cases.first_step_grads(0, 1, FIVE)


@pytest.fixture(scope="module")
def distributed():
    return run_dist(2, cases.grad_cases, {name: FIVE + CKPT + ov for name, ov in DIST.items()})[0]


@pytest.mark.parametrize("every", [2, 3, 7])
def test_segments_are_bitwise_the_plain_model(reference, every):
    """k = 2, k = 3 (not dividing the 5 layers: segments {0,1,2} {3,4}) and k > L (one segment)."""
    got = cases.first_step_grads(0, 1, FIVE + CKPT + [f"memory.checkpoint_every={every}"])
    assert got["loss"] == reference["loss"]
    for name, g in reference["grads"].items():
        assert torch.equal(got["grads"][name], g), name


@pytest.mark.parametrize("extra", [["memory.checkpoint_every=3", "memory.layer_chunk_size=24", "memory.mst=true"],
                                   ["memory.layer_chunk_size=8"] + FPDT,
                                   ["memory.layer_chunk_size=40", "memory.checkpoint_every=2",
                                    "memory.fpdt_offload=false"] + FPDT],
                         ids=["k3-chunks-mst", "fpdt-chunked", "fpdt-chunked-k2-no-offload"])
def test_one_process_within_the_contract(reference, extra):
    got = cases.first_step_grads(0, 1, FIVE + CKPT + extra)
    assert_close_loss(got["loss"], reference["loss"])
    assert_close_grads(got["grads"], reference["grads"])


@pytest.mark.parametrize("name", list(DIST))
def test_layouts_equal_the_plain_model(reference, distributed, name):
    got = distributed[name]
    assert_close_loss(got["loss"], reference["loss"])
    assert_close_grads(got["grads"], reference["grads"])


def _trainer(extra):
    cfg = load_config(None, cases.TINY + FIVE + CKPT + ["train.train_iters=1", "checkpoint.save=null"] + extra)
    return cfg, Trainer(cfg, Topology())


@pytest.mark.parametrize("every", [1, 2, 3])
def test_host_holds_exactly_one_input_per_segment(every):
    """ceil(L / k) layer inputs reserved, sent and on the host at once (the pool is sized to them exactly: one more
    would not fit); everything back in the pool after the step, nothing re-made left on the device."""
    cfg, t = _trainer([f"memory.checkpoint_every={every}"])
    rt: CheckpointOffload = t.ctx.checkpoints
    per_layer = cfg.data.seq_length * 4 * cfg.model.hidden_size * 4  # fp32 [64, 4, 64]
    segments = -(-5 // every)
    assert rt.pool.reserved[CheckpointOffload.TAG] == segments * per_layer
    t.train()
    assert rt.bytes_to_host == segments * per_layer and rt.host_blocks_peak == segments
    assert not rt.host and not rt.fetched and not rt.remade and not rt.forwards and rt.pool.fit.used == 0


def test_segment_rerun_costs_the_lower_layers_once_more():
    """k = 3, 5 layers: forward 5 layer runs, re-making 3 (layers 0, 1 and 3: every layer but a segment's top, L -
    ceil(L / k)), re-run 5: 13 MLP calls per micro-batch."""
    _, t = _trainer(["memory.checkpoint_every=3", "train.global_batch_size=4"])
    calls = []
    for layer in t.model.layers:
        layer.mlp.register_forward_hook(lambda m, args, out, n=layer.layer_number: calls.append(n))
    t.train()
    assert sorted(calls) == sorted(list(range(5)) * 2 + [0, 1, 3]), calls


def test_fpdt_chunked_layer_runs_post_per_chunk_and_norm_inside_the_block():
    """FPDT's block as the chunked layer's attention: the MLP sees at most a chunk of rows (8 of the 16 local rows of
    an FPDT chunk, 64 tokens = 4 FPDT chunks: 8 calls a run) and norm 1 runs on the block's chunks (16 rows, 4 a
    run), never on the whole sequence. Forward + re-run per layer."""
    _, t = _trainer(FPDT + ["memory.layer_chunk_size=8", "train.micro_batch_size=1", "train.global_batch_size=1"])
    mlp, norm = [], []
    for layer in t.model.layers:
        layer.mlp.register_forward_hook(lambda m, args, out: mlp.append(args[0].shape[0]))
        layer.input_layernorm.register_forward_hook(lambda m, args, out: norm.append(args[0].shape[0]))
    t.train()
    assert set(mlp) == {8} and len(mlp) == 5 * 2 * 8, mlp
    assert set(norm) == {16} and len(norm) == 5 * 2 * 4, norm


@pytest.mark.parametrize("extra,keys", [
    (["memory.checkpoint_every=2"], ["memory.checkpoint_every=2", "memory.activation_offload=none"]),
    (["memory.checkpoint_every=2", "memory.activation_offload=memo"], ["checkpoint_every", "activation_offload=memo"]),
    (["memory.checkpoint_every=0"] + CKPT, ["memory.checkpoint_every (0) must be >= 1"]),
    (["memory.recompute_granularity=full", "memory.layer_chunk_size=8"] + FPDT, ["layer_chunk_size", "cp_comm_type"]),
])
def test_refusals_are_one_line(extra, keys):
    with pytest.raises(ConfigError) as e:
        resolve_layout(load_config(None, cases.TINY + extra), 1)
    assert "\n" not in str(e.value) and all(k in str(e.value) for k in keys), str(e.value)
