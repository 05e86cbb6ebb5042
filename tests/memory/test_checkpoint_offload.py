"""``memory.activation_offload: checkpoints``: each layer's input on the host, the whole layer re-run in backward.

Exactness: the re-run is the same forward on the same (copied) input, so on one CPU process the loss and every
gradient equal the plain model's bit for bit; under FSDP2 and context parallel the reduction order of the layout
differs (measured <= 1e-8 absolute on the grads), asserted at the contract (loss 1e-5 relative, grads 1e-4)."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.config import ConfigError, Execution, load_config, resolve_layout
from megatron_lc.memory.checkpoint_offload import CheckpointOffload
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases import fsdp as cases
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads, assert_close_loss

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


CHUNKS = CKPT + ["train.micro_batch_size=4"]


@pytest.mark.parametrize("world,overrides", [
    (1, CHUNKS + ["memory.layer_chunk_size=24"]),  # 64 tokens: 24 + 24 + 16
    (2, CHUNKS + ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                  "memory.layer_chunk_size=10"]),  # 32 rows per rank, q/k/v gathered x 2
    (2, CHUNKS + ["parallel.context_parallel_size=2", "parallel.ulysses_size=2", "parallel.cp_comm_type=a2a",
                  "parallel.use_torch_fsdp2=true", "memory.mst=true", "memory.layer_chunk_size=8"]),
], ids=["one-uneven", "tp2-sp", "ulysses2-fsdp2-mst"])
def test_chunked_rerun_equals_the_plain_model(reference, world, overrides):
    """``layer_chunk_size`` in the checkpoints mode: the forward and the re-run take pre/post a chunk at a time
    (``memory/chunked_layer.py``). Row-wise ops, so only GEMM blocking moves the last bits (measured: loss equal,
    grads <= 9.4e-9 absolute); asserted at the contract (loss 1e-5 relative, grads 1e-4)."""
    got = (cases.first_step_grads(0, 1, overrides) if world == 1
           else run_dist(world, cases.first_step_grads, overrides)[0])
    assert_close_loss(got["loss"], reference["loss"])
    assert_close_grads(got["grads"], reference["grads"])


def test_chunked_rerun_runs_the_token_wise_parts_per_chunk():
    """Every call of the MLP and of the QKV projection -- forward and re-run -- sees at most a chunk of rows (16 of
    the 64 tokens), 4 chunks each time: per layer QKV 4 + MLP 4 in the forward, QKV 4 (q, k, v for the attention)
    + MLP 4 (post backward) + QKV 4 (pre backward) in the re-run."""
    cfg = load_config(None, cases.TINY + CKPT + ["memory.layer_chunk_size=16", "train.micro_batch_size=1",
                                                 "train.global_batch_size=1", "train.train_iters=1",
                                                 "checkpoint.save=null"])
    t = Trainer(cfg, Topology())
    rows = []
    for layer in t.model.layers:
        for mod in (layer.mlp, layer.self_attention.linear_qkv):
            mod.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    t.train()
    assert max(rows) == 16 and len(rows) == 2 * (8 + 12), rows


def test_rerun_under_the_forwards_autocast():
    """With ``train.bf16`` the forward autocasts and autograd runs the backward outside that context: the re-run
    must enter the forward's autocast again, or its bf16 tensors become fp32 ones and the gradients are not those of
    the forward (measured with the re-run outside autocast: loss equal, grads off by 0.75% of their max). Here CPU
    autocast to bf16 stands in for CUDA's: the checkpoints mode equals the plain model bit for bit."""
    def grads(extra):
        cfg = load_config(None, cases.TINY + ["train.micro_batch_size=4", "train.clip_grad=0",
                                              "checkpoint.save=null"] + extra)
        t = Trainer(cfg, Topology())
        t.execution = Execution(torch.device("cpu"), torch.bfloat16)  # CPU autocast stands for CUDA's
        t.optimizer.zero_grad(set_to_none=True)
        loss = float(t.forward_backward(t.microbatches(0)))
        return loss, {n: p.grad for n, p in t.model.named_parameters()}

    (l0, g0), (l1, g1) = grads([]), grads(CKPT)
    assert l1 == l0
    for name, g in g0.items():
        assert torch.equal(g1[name], g), name


def test_bf16_residual_stream_under_autocast():
    """``model.fp32_residual_connection: false`` (Megatron's default): under bf16 autocast every layer's input is
    bf16 -- what the host checkpoints then hold (half the bytes) -- and the checkpoints mode, chunked or not, still
    equals the plain model with the same setting (bit for bit unchunked; chunked within bf16's rounding: the
    smaller GEMMs may round the last bf16 bit differently). The default keeps the residual fp32."""
    def run(extra, record=None):
        cfg = load_config(None, cases.TINY + ["train.micro_batch_size=4", "train.clip_grad=0",
                                              "checkpoint.save=null"] + extra)
        t = Trainer(cfg, Topology())
        t.execution = Execution(torch.device("cpu"), torch.bfloat16)  # CPU autocast stands for CUDA's
        if record is not None:
            for layer in t.model.layers:
                layer.register_forward_pre_hook(lambda m, args: record.append(args[0].dtype))
        t.optimizer.zero_grad(set_to_none=True)
        loss = float(t.forward_backward(t.microbatches(0)))
        return loss, {n: p.grad for n, p in t.model.named_parameters()}

    bf16_res = ["model.fp32_residual_connection=false"]
    dtypes, default = [], []
    l0, g0 = run(bf16_res, dtypes)
    run([], default)
    assert set(dtypes) == {torch.bfloat16} and set(default) == {torch.float32}, (dtypes, default)
    l1, g1 = run(bf16_res + CKPT)
    assert l1 == l0 and all(torch.equal(g1[n], g) for n, g in g0.items())
    l2, g2 = run(bf16_res + CKPT + ["memory.layer_chunk_size=24"])
    assert abs(l2 - l0) <= 1e-2 * abs(l0)  # bf16 rounding (eps 2^-8) of chunk-shaped GEMMs, not a wrong gradient
    for n, g in g0.items():
        assert (g2[n] - g).abs().max() <= 2e-2 * g.abs().max(), n
