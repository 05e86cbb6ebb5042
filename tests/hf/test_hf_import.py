"""tools/convert_from_hf.py (``megatron_lc.hf.import_hf``): a random tiny Hugging Face Llama (built here with
transformers; nothing is downloaded) imports as a checkpoint that loads at tp 1 and 2 with HF's logits, exports back
bit for bit, and trains on.

Tolerance of the logits: both sides run fp32 on CPU and differ only in how sums are ordered (one fused QKV matmul
vs three, SDPA vs HF's eager attention, RoPE frequencies rounded from float64 vs computed in float32), ~1e-7
relative each for logits of magnitude ~1: 1e-5 absolute (measured ~3e-7), far below a mapping mistake."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lc.config import ConfigError
from megatron_lc.hf import import_hf
from tests.dist_cases import export as dist_cases_export
from tests.support.dist import run_dist

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_to_hf  # noqa: E402

ATOL = 1e-5
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def hf_llama(path, tied=False, rope=None, shard=None, head_dim=None, seed=0):
    """A random tiny LlamaForCausalLM saved with save_pretrained (safetensors; sharded when ``shard`` is set)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                                   max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                                   rope_parameters={**(rope or {"rope_type": "default"}), "rope_theta": 5000.0})
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    return model


def hf_logits(model, tokens):
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(input_ids=tokens).logits


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tied,sharded", [(False, False), (True, True)], ids=["untied", "tied-sharded"])
def test_hf_to_ours_to_hf_is_bitwise(tmp_path, tied, sharded):
    hf = hf_llama(tmp_path / "hf", tied=tied, shard="40KB" if sharded else None)
    if sharded:
        assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=2)
    convert_to_hf.convert(str(tmp_path / "ours"), str(tmp_path / "back"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    ref = {k: v for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert back.keys() == ref.keys()
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg == json.loads((tmp_path / "hf" / "config.json").read_text())  # as imported, key for key
    assert cfg["tie_word_embeddings"] == tied and cfg["rope_parameters"]["rope_theta"] == 5000.0


@pytest.mark.parametrize("world,rope,head_dim", [(1, None, None), (2, None, None), (2, LLAMA3_ROPE, 16)],
                         ids=["tp1", "tp2", "tp2-llama3-rope-headdim16"])
def test_imported_model_gives_hf_logits(tmp_path, world, rope, head_dim):
    hf = hf_llama(tmp_path / "hf", rope=rope, head_dim=head_dim)
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=1)  # written at tp 1, loaded at `world`
    _, logits = run_dist(world, dist_cases_export.imported_logits, str(tmp_path / "ours"),
                         ["train.train_iters=0"], TOKENS)[0]
    err = (logits - hf_logits(hf, TOKENS)).abs().max().item()
    assert err <= ATOL, f"max |ours - HF| logits = {err:.3e}"


def test_training_continues_from_the_import(tmp_path):
    hf_llama(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"), tp=2)
    losses, _ = run_dist(2, dist_cases_export.imported_logits, str(tmp_path / "ours"),
                         ["train.train_iters=3", "train.lr=1e-3", "checkpoint.finetune=true",
                          f"checkpoint.save={tmp_path / 'stage1'}"], TOKENS)[0]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert os.path.isfile(tmp_path / "stage1" / "iter_0000003" / "meta.json")


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"},
     "cannot import this Hugging Face model: architecture Gemma2ForCausalLM (model_type 'gemma2'; supported: "
     "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, "
     "Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM)"),
    ({"hidden_act": "gelu"}, "cannot import this Hugging Face model: hidden_act='gelu' (only silu)"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5000.0}},
     "rope_scaling type 'dynamic' is not supported (supported: linear, llama3, yarn)"),
])
def test_unsupported_models_are_one_line_errors(tmp_path, change, message):
    hf_llama(tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ConfigError) as e:
        import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert str(e.value) == message
    out = subprocess.run([sys.executable, "tools/convert_from_hf.py", str(tmp_path / "hf"), str(tmp_path / "o2")],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 2 and out.stderr == f"error: {message}\n"
