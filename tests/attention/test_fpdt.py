"""FPDT (chunked Ulysses attention with host offload): layout, config errors, block and model parity, training.

Every parity test compares forward AND backward with the plain single-process computation (tolerances:
tests/dist_cases/fpdt.py and tests/support/parity.py)."""
import pytest
import torch

from megatron_lc.attention.fpdt.block import FPDTSelfAttention
from megatron_lc.attention.fpdt.host_share import reserve_for_layers
from megatron_lc.config import ConfigError, resolve_layout
from megatron_lc.config.layout import kv_replication
from megatron_lc.model.attention import SelfAttention
from megatron_lc.parallel.token_layout import chunk_rows, fpdt_token_index
from tests.dist_cases import fpdt as cases
from tests.support.dist import run_dist
from tests.support.parity import block_parts, small_config

HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA; GQA (kv heads < P=4: replicated); MQA (kv heads < P=2, 4)


# ---- layout --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,u,spt", [(1, 4, 1), (2, 2, 1), (4, 2, 1), (2, 4, 2), (1, 2, 2)])
def test_strided_layout_gathers_global_ranges(P, u, spt):
    s = 64
    idx = [fpdt_token_index(s, P, r, u, spt) for r in range(P)]
    assert torch.equal(torch.sort(torch.cat(idx)).values, torch.arange(s))  # a partition of the sequence
    rows = chunk_rows(s // P, u, spt)
    for i in range(u):  # chunk i: tp all-gather (rows in gathered order), then all-to-all in rank order
        gathered = torch.cat([idx[r][rows[i]] for r in range(P)])
        assert torch.equal(gathered, torch.arange(i * s // u, (i + 1) * s // u)), (P, u, spt, i)


def test_layout_example_from_docs():
    assert fpdt_token_index(16, 2, 0, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert fpdt_token_index(16, 2, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    assert fpdt_token_index(16, 1, 0, 2, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]


def test_kv_replication():
    assert kv_replication(8, 8, 4) == 1 and kv_replication(8, 4, 4) == 1
    assert kv_replication(8, 2, 4) == 2 and kv_replication(8, 1, 4) == 4 and kv_replication(8, 1, 2) == 2
    assert kv_replication(12, 3, 2) == 2  # neither divides the other: q heads 0-5 -> kv copies 0-2 of 6
    with pytest.raises(ConfigError, match="divisible by the Ulysses size"):
        kv_replication(6, 2, 4)


# ---- config errors -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("over,msg", [
    (["memory.fpdt_chunk_size=12"], r"memory.fpdt_chunk_size \(12\) must divide data.seq_length \(32\)"),
    (["memory.fpdt_chunk_size=64"], r"memory.fpdt_chunk_size \(64\) must divide data.seq_length \(32\)"),
    (["memory.fpdt_chunk_size=2", "parallel.context_parallel_size=4"],
     r"memory.fpdt_chunk_size \(2\) must be divisible by cp \(4\)"),
    (["memory.fpdt_chunk_size=2", "parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
      "parallel.sequence_parallel=true"], r"must be divisible by cp \(2\) x tp \(2\) with sequence_parallel = 4"),
])
def test_config_errors(over, msg):
    cfg = small_config(["parallel.cp_comm_type=fpdt"] + over)
    world = cfg.parallel.context_parallel_size * cfg.parallel.tensor_model_parallel_size
    with pytest.raises(ConfigError, match=msg):
        resolve_layout(cfg, world)


# ---- one attention block vs single-process attention -----------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 4])
def test_block_matches_single_process(P):
    grid = [(u, nq, nkv, off, "auto") for u in (1, 2, 4) for nq, nkv in HEADS for off in (True, False)]
    results = run_dist(P, cases.block_parity, grid)
    assert len(results[0]) == len(grid)
    peaks = {c[:4]: r["peak"] for c, r in zip(grid, results[0])}
    for nq, nkv in HEADS:  # with offload, the block's device bytes fall with the chunk count (bench: figures)
        assert peaks[(4, nq, nkv, True)] < peaks[(2, nq, nkv, True)] < peaks[(1, nq, nkv, True)]
        assert peaks[(4, nq, nkv, True)] <= 0.5 * peaks[(1, nq, nkv, True)], peaks


# ---- the whole model -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,tp,over", [
    (2, 1, ["memory.fpdt_chunk_size=8", "memory.fpdt_offload=true"]),      # P=2, u=4, offload
    (2, 1, ["memory.fpdt_chunk_size=8", "memory.fpdt_offload=false"]),     # P=2, u=4, no offload
    (1, 1, ["memory.fpdt_chunk_size=8"]),                                  # P=1, u=4
    (4, 2, ["memory.fpdt_chunk_size=16", "parallel.sequence_parallel=false"]),  # tp=2 x P=2, u=2
    (4, 2, ["memory.fpdt_chunk_size=8", "parallel.sequence_parallel=true"]),    # tp=2 (SP) x P=2, u=4
    (2, 2, ["memory.fpdt_chunk_size=8", "parallel.sequence_parallel=true"]),    # tp=2 (SP), P=1, u=4
    (2, 1, ["memory.fpdt_chunk_size=16", "model.normalization=LayerNorm", "model.swiglu=false",  # GPT: learned
            "model.position_embedding_type=learned_absolute", "model.add_bias_linear=true",    # positions, biases,
            "model.untie_embeddings_and_output_weights=false", "model.max_position_embeddings=64"]),  # tied head
])
def test_model_matches_single_process(world, tp, over):
    losses = run_dist(world, cases.model_parity, over, tp)
    assert len(set(losses)) == 1


def test_training_fpdt_p2_u4_matches_cp1():
    """5 steps of the real loop: FPDT (P=2, u=4, offload) vs cp=1 on one rank; same losses."""
    common = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=256",
              "model.make_vocab_size_divisible_by=64", "data.seq_length=64", "data.mock_data=true",
              "data.prepare_demo_data=false", "train.train_iters=5", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.lr_warmup_iters=1", "checkpoint.save=null",
              "checkpoint.save_interval=null", "logging.metrics_file=/dev/null"]
    fpdt = run_dist(2, cases.train_losses, common + ["memory.fpdt_chunk_size=16"])
    base = run_dist(1, cases.train_losses, common + ["parallel.context_parallel_size=1",
                                                     "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1"])
    assert fpdt[0] == fpdt[1]
    assert len(base[0]) == 5
    for step, (a, b) in enumerate(zip(fpdt[0], base[0])):
        # 1e-5 relative: the contract; the two runs differ only in summation order (see dist_cases_fpdt.py)
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: fpdt {a!r} vs cp=1 {b!r}"


# ---- in-process (P = 1) details --------------------------------------------------------------------------------------
def _p1_block(u=4, offload=True):
    cfg = small_config(["parallel.cp_comm_type=fpdt", f"memory.fpdt_chunk_size={32 // u}",
                        f"memory.fpdt_offload={offload}"])
    torch.manual_seed(0)
    ref = SelfAttention(cfg.model, block_parts(small_config()), 0, 0.02)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    block = FPDTSelfAttention(cfg.model, block_parts(cfg), 0, 0.02)
    block.load_state_dict(ref.state_dict())
    return block, cfg


def test_no_grad_forward_matches_and_keeps_nothing():
    from megatron_lc.model.rope import RotaryEmbedding

    block, cfg = _p1_block()
    x = torch.randn(32, 2, cfg.model.hidden_size)
    rope = RotaryEmbedding(cfg.model.kv_channels, 10000.0)(torch.arange(32).view(32, 1).expand(32, 2))
    reserve_for_layers(block, x, rope, 1)  # the host pool: one block's parked chunks, measured
    with torch.no_grad():
        y0 = block(x, rope)
    assert block.state.account.current == 0 and block.state.host_account.current == 0
    y1 = block(x.requires_grad_(), rope)
    assert torch.equal(y0, y1.detach())  # same arithmetic with and without the autograd graph


def test_wrong_runtime_length_is_a_clear_error():
    block, cfg = _p1_block(u=4)
    x = torch.randn(30, 2, cfg.model.hidden_size)
    with pytest.raises(ConfigError, match=r"local sequence \(30 tokens on this rank\) is not divisible into 4 chunks"):
        block(x, None)


def test_offloaded_projections_do_not_pin_the_block_input():
    """With offload, what the chunk projections saved lives on the host; their gradient leaves are views of the block
    input (the norm's output) and held it on the device through the layer's backward: one residual-stream tensor,
    2 GiB at Llama3-8B x 1M on 8 ranks (fp32 residual), seen by the rehearsal. Now it goes when its last user does."""
    from megatron_lc.model.rope import RotaryEmbedding
    from megatron_lc.planning.capture.tracker import DispatchTracer

    block, cfg = _p1_block()
    x = torch.randn(32, 2, cfg.model.hidden_size, requires_grad=True)
    rope = RotaryEmbedding(cfg.model.kv_channels, 10000.0)(torch.arange(32).view(32, 1).expand(32, 2))
    reserve_for_layers(block, x.detach(), rope, 1)
    with DispatchTracer() as tracker:
        h = x * 1.0  # the block input: an intermediate of the graph, as the norm's output is
        y = block(h, rope)
        before, nbytes = tracker.live_bytes(), h.untyped_storage().nbytes()
        del h
        assert before - tracker.live_bytes() == nbytes  # its storage went with the last reference
    y.square().sum().backward()
    ref = x.detach().clone().requires_grad_()
    block2, _ = _p1_block(offload=False)
    (block2(ref * 1.0, rope)).square().sum().backward()
    assert torch.equal(x.grad, ref.grad)  # the same gradient, bit for bit, as without offload
