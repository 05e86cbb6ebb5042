"""Config: strict keys, typed values, overrides, one-line layout errors, and every shipped config loads."""
import glob
import os

import pytest

from megatron_lc.config import Config, ConfigError, load_config, resolve_layout

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SHIPPED = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))
                 + glob.glob(os.path.join(ROOT, "configs", "*", "stage*.yaml")))


def test_shipped_configs_exist():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"tiny_cpu.yaml", "llama3_8b_1m.yaml", "gpt_7b.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.context_parallel_size * int(os.environ.get("DP_FOR_TEST", 1))
    assert resolve_layout(cfg, world).dp >= 1


def test_big_configs_have_the_published_shapes():
    m = load_config(os.path.join(ROOT, "configs", "llama3_8b_1m.yaml")).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
            m.vocab_size, m.rotary_base) == (32, 4096, 32, 8, 14336, 128256, 500000)
    assert 8.0e9 < m.num_parameters() < 8.1e9
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b_1m.yaml"))
    assert cfg.data.seq_length == 1048576
    g = load_config(os.path.join(ROOT, "configs", "gpt_7b.yaml")).model
    assert (g.num_layers, g.hidden_size, g.ffn_hidden_size, g.num_attention_heads, g.vocab_size) == \
        (32, 4096, 16384, 32, 50257)


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.hiden_size=3"])
    msg = str(e.value)
    assert "unknown key 'model.hiden_size'" in msg and "hidden_size" in msg and "num_layers" in msg
    assert "\n" not in msg


def test_unknown_section_and_bad_override():
    with pytest.raises(ConfigError, match="unknown section 'modle'"):
        Config.from_dict({"modle": {}})
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["train.lr"])


def test_types_are_checked_and_coerced():
    cfg = load_config(None, ["train.lr=1e-4", "train.train_iters=5", "parallel.sequence_parallel=true",
                             "memory.offload_fraction=0.25", "checkpoint.save=null"])
    assert cfg.train.lr == 1e-4 and cfg.train.train_iters == 5 and cfg.parallel.sequence_parallel is True
    assert cfg.memory.offload_fraction == 0.25 and cfg.checkpoint.save is None
    assert load_config(None, ["memory.offload_fraction=auto"]).memory.offload_fraction == "auto"
    with pytest.raises(ConfigError, match=r"train.train_iters: expected an integer, got 'five'"):
        load_config(None, ["train.train_iters=five"])
    with pytest.raises(ConfigError, match="parallel.cp_comm_type: 'ring' is not one of"):
        load_config(None, ["parallel.cp_comm_type=ring"])
    with pytest.raises(ConfigError, match=r"memory.offload_fraction \(1.5\) must be in \[0, 1\]"):
        load_config(None, ["memory.offload_fraction=1.5"])


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))


@pytest.mark.parametrize("overrides,world,message", [
    (["model.num_attention_heads=6", "model.hidden_size=96", "parallel.tensor_model_parallel_size=4"], 4,
     r"model.num_attention_heads \(6\) must be divisible by tp \(4\)"),
    (["parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=2"], 6,
     r"world size \(6\) must be divisible by tp \(2\) x cp \(2\) = 4"),
    (["model.num_query_groups=2", "parallel.tensor_model_parallel_size=4"], 4,
     r"model.num_query_groups \(2\) must be divisible by tp \(4\)"),
    (["data.seq_length=100", "parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"], 4,
     r"data.seq_length \(100\) must be divisible by 8 for cp \(4, p2p\)"),
    (["data.seq_length=30", "parallel.tensor_model_parallel_size=4", "parallel.sequence_parallel=true"], 4,
     r"data.seq_length \(30\) must be divisible by 4"),
    (["train.global_batch_size=3", "train.micro_batch_size=1"], 2,
     r"train.global_batch_size \(3\) must be divisible by micro_batch_size \(1\) x dp \(2\)"),
    (["model.num_attention_heads=8", "model.num_query_groups=3"], 1,
     r"model.num_attention_heads \(8\) must be divisible by model.num_query_groups \(3\)"),
])
def test_impossible_layouts_give_one_line_errors(overrides, world, message):
    with pytest.raises(ConfigError, match=message) as e:
        resolve_layout(load_config(None, overrides), world)
    assert "\n" not in str(e.value)
