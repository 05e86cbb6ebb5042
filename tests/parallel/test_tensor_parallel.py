"""tp=2 equals tp=1: loss and every gradient, with and without Megatron sequence parallelism, Llama and GPT."""
import pytest

from tests.dist_cases import tp as dist_cases_tp
from tests.support.dist import run_dist

GPT = ["model.normalization=LayerNorm", "model.swiglu=false", "model.position_embedding_type=learned_absolute",
       "model.add_bias_linear=true", "model.untie_embeddings_and_output_weights=false",
       "model.max_position_embeddings=64"]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_tp2_matches_single_process(sp, arch):
    overrides = [f"parallel.sequence_parallel={sp}"] + (GPT if arch == "gpt" else [])
    losses = run_dist(2, dist_cases_tp.tp_parity, overrides)
    assert losses[0] == losses[1]
