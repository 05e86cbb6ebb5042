"""MsT under parallel layouts equals the single-process unchunked model (loss and every gradient):
tp=2 (vocab-parallel head: softmax max/sum reduced over the two vocab shards per chunk; column/row MLP) with and
without Megatron sequence parallelism (the MLP and head all-gather the sequence before chunking); context
parallelism (ring, Ulysses x tp x SP, FPDT: the blocks are token-wise, any token subset/order is chunked alike);
uneven chunks, ignored labels, per-token loss weights. And 5 training steps with MsT give the losses without it.
Tolerances: see tests/memory/mst/test_mst.py and tests/support/parity.py (reordered fp32 sums, ~1e-7 relative)."""
import pytest

from tests.dist_cases import cp as dist_cases_cp
from tests.dist_cases import fpdt as dist_cases_fpdt
from tests.dist_cases import mst as dist_cases_mst
from tests.support.dist import run_dist
from tests.support.parity import LOSS_RTOL

GPT = ["model.normalization=LayerNorm", "model.swiglu=false", "model.position_embedding_type=learned_absolute",
       "model.add_bias_linear=true", "model.untie_embeddings_and_output_weights=false",
       "model.max_position_embeddings=64"]
MST = ["memory.mst=true", "memory.mst_mlp_chunk_size=7", "memory.mst_head_chunks=5"]


@pytest.mark.parametrize("sp,arch,weighted", [(False, "llama", True), (True, "llama", False), (True, "gpt", True),
                                               (False, "gpt", False)])
def test_mst_tp2_matches_single_process(sp, arch, weighted):
    """weighted: per-token loss weights (head dW recomputed in backward); else the loop's 0/1 mask (from forward)."""
    overrides = [f"parallel.sequence_parallel={sp}"] + MST[1:]
    losses = run_dist(2, dist_cases_mst.mst_tp_parity, overrides + (GPT if arch == "gpt" else []), weighted)
    assert losses[0] == losses[1]


CP_CASES = {
    "ring-cp2": (2, dist_cases_cp.cp_overrides("p2p", 2)),
    "ulysses-cp2-tp2-sp": (4, dist_cases_cp.cp_overrides("a2a", 2, tp=2) + ["parallel.sequence_parallel=true"]),
}


@pytest.mark.parametrize("name", list(CP_CASES))
def test_mst_with_context_parallel(name):
    world, overrides = CP_CASES[name]
    losses = run_dist(world, dist_cases_cp.model_parity, overrides + MST)
    assert max(losses) - min(losses) <= LOSS_RTOL * abs(losses[0])


def test_mst_with_fpdt():
    losses = run_dist(2, dist_cases_fpdt.model_parity, MST + ["memory.fpdt_chunk_size=4"], 1)
    assert max(losses) - min(losses) <= LOSS_RTOL * abs(losses[0])


def test_mst_training_matches_plain(tmp_path):
    """5 AdamW steps of the real loop (Trainer) with MsT chunking everything vs without: fp32 reordering only."""
    small = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.vocab_size=256",
             "model.make_vocab_size_divisible_by=64", "data.mock_data=true", "data.seq_length=64",
             "train.micro_batch_size=2", "train.global_batch_size=4", "train.train_iters=5",
             "train.lr_warmup_iters=1", "checkpoint.save=", "logging.log_interval=5"]
    ref = run_dist(1, dist_cases_cp.train_losses, "configs/tiny_cpu.yaml", small, str(tmp_path / "a.jsonl"))[0]
    got = run_dist(1, dist_cases_cp.train_losses, "configs/tiny_cpu.yaml", small + MST[:1]
                   + ["memory.mst_mlp_chunk_size=16", "memory.mst_head_chunks=8"], str(tmp_path / "b.jsonl"))[0]
    assert len(got) == 5
    for g, r in zip(got, ref):
        assert abs(g - r) <= LOSS_RTOL * abs(r), (got, ref)
