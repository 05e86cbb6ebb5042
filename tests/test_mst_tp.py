"""MsT under tp=2 equals the single-process unchunked model: vocab-parallel head (softmax max/sum reduced over the
two vocab shards per chunk), column/row MLP, with and without Megatron sequence parallelism (the MLP and head
all-gather the sequence before chunking), uneven chunks, ignored labels, a non-uniform loss mask.
Tolerances: see tests/test_mst.py (reordered fp32 sums, ~1e-7 relative)."""
import pytest

from tests import dist_cases_mst
from tests.dist import run_dist

GPT = ["model.normalization=LayerNorm", "model.swiglu=false", "model.position_embedding_type=learned_absolute",
       "model.add_bias_linear=true", "model.untie_embeddings_and_output_weights=false",
       "model.max_position_embeddings=64"]


@pytest.mark.parametrize("sp,arch", [(False, "llama"), (True, "llama"), (True, "gpt")])
def test_mst_tp2_matches_single_process(sp, arch):
    overrides = [f"parallel.sequence_parallel={sp}", "memory.mst_mlp_chunk_size=7", "memory.mst_head_chunks=5"]
    losses = run_dist(2, dist_cases_mst.mst_tp_parity, overrides + (GPT if arch == "gpt" else []))
    assert losses[0] == losses[1]
