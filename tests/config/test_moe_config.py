"""The MoE keys of ``model:`` (config/moe.py) and expert parallelism's refused pairs (config/combinations.py), each
one line naming the keys, before anything is built; the MoE layer pattern and the parameter counts."""
from __future__ import annotations

import pytest

from megatron_lc.config import ConfigError, load_config, resolve_layout

MOE = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_moe_experts=8",
       "model.moe_ffn_hidden_size=32", "model.vocab_size=256", "data.seq_length=32", "train.device=cpu"]


@pytest.mark.parametrize("sets,world,message", [
    (["parallel.expert_model_parallel_size=2"], 2,
     "parallel.expert_model_parallel_size=2 without model.num_moe_experts: there are no experts to shard"),
    (MOE + ["parallel.tensor_model_parallel_size=2"], 2,
     "model.num_moe_experts with parallel.tensor_model_parallel_size=2 and sequence_parallel false"),
    (MOE + ["parallel.expert_model_parallel_size=2", "parallel.use_distributed_optimizer=true"], 2,
     "parallel.expert_model_parallel_size=2 with parallel.use_distributed_optimizer: ZeRO-1 shards"),
    (MOE + ["parallel.expert_model_parallel_size=2", "memory.activation_offload=memo"], 2,
     "parallel.expert_model_parallel_size=2 with memory.activation_offload=memo: the rows an expert rank receives"),
    (MOE + ["model.moe_layer_freq=2", "memory.activation_offload=memo"], 1,
     "model.moe_layer_freq=2 with memory.activation_offload=memo: Memo sizes its rounding buffers by layer 0"),
    (MOE + ["parallel.expert_model_parallel_size=3"], 3,
     "parallel.expert_model_parallel_size (3) must divide model.num_moe_experts (8)"),
    (MOE + ["parallel.expert_model_parallel_size=4"], 2,
     "parallel.expert_model_parallel_size (4) must divide dp x cp (2 x 1 = 2)"),
])
def test_refused_pairs_are_one_line(sets, world, message):
    with pytest.raises(ConfigError) as e:
        resolve_layout(load_config(None, sets), world)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("sets,message", [
    (["model.moe_aux_loss_coeff=0.01"], "model.moe_aux_loss_coeff is set but model.num_moe_experts is not"),
    (MOE + ["model.moe_router_topk=9"], "model.moe_router_topk (9) must be between 1 and model.num_moe_experts (8)"),
    (MOE + ["model.swiglu=false", "model.gated_linear_unit=false"], "the experts are SwiGLU"),
    (MOE + ["model.moe_layer_freq=1,0"], "model.moe_layer_freq [1, 0] must have one 0 (dense) or 1 (MoE) per layer"),
    (MOE + ["model.moe_shared_expert_gate=true"], "model.moe_shared_expert_gate without"),
])
def test_bad_moe_keys_are_one_line(sets, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, sets)
    assert message in str(e.value), str(e.value)


def test_layer_pattern_and_parameter_counts():
    m = load_config(None, MOE + ["model.moe_layer_freq=0,1,1,1", "model.moe_router_topk=2"]).model
    assert m.moe_layers() == (False, True, True, True)
    assert load_config(None, MOE + ["model.moe_layer_freq=2"]).model.moe_layers() == (True, False, True, False)
    h, f, e, k = 64, 32, 8, 2
    per_moe, per_moe_active = e * h + e * 3 * h * f, e * h + k * 3 * h * f
    assert m.num_parameters() - m.num_active_parameters() == 3 * (per_moe - per_moe_active)
    dense = load_config(None, [s for s in MOE if "moe" not in s]).model
    assert m.num_parameters() - dense.num_parameters() == 3 * (per_moe - 3 * h * dense.ffn_hidden_size)
