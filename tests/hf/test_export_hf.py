"""tools/convert_to_hf.py: the exported directory loads in transformers.LlamaForCausalLM and gives the framework's
logits on the same tokens, for tp=1 and tp=2 checkpoints (shards merged), GQA, tied and untied heads, biases.

Tolerance: both sides run fp32 on CPU; they differ only in how sums are ordered (one fused QKV matmul vs three,
our SDPA call vs HF's eager attention, RoPE frequencies rounded from float64 vs computed in float32), each ~1e-7
relative, for logits of magnitude ~1. Measured max |difference|: 2.4e-7 to 3.0e-7. 1e-5 absolute leaves 30x
margin and is far below any mapping mistake (swapping gate and up gave 1.5e-2 to 2.7e-2)."""
import importlib.util
import json
import os
import sys

import pytest
import torch

from tests.dist_cases import export as dist_cases_export
from tests.support.dist import run_dist

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "tools"))
import convert_to_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

TRAIN = ["train.train_iters=2", "train.global_batch_size=2", "train.lr=1e-2", "model.rotary_base=5000",
         "model.vocab_size=250", "model.norm_epsilon=1e-6"]
ATOL = 1e-5


def _export_and_compare(tmp_path, world, extra, **convert_kwargs):
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(3))
    logits = run_dist(world, dist_cases_export.train_and_logits, TRAIN + [f"checkpoint.save={ck}"] + extra,
                      tokens)[0]
    convert_to_hf.convert(ck, out, **convert_kwargs)
    model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        hf = model(input_ids=tokens).logits
    vocab = hf.shape[-1]
    err = (hf - logits[..., :vocab]).abs().max().item()
    assert err <= ATOL, f"max |HF - framework| logits = {err:.3e}"
    return out, model, logits


@pytest.mark.parametrize("world,extra", [
    (1, []),  # GQA 8 heads / 4 kv heads, untied head
    (2, ["parallel.tensor_model_parallel_size=2", "model.num_query_groups=2"]),
    (2, ["parallel.tensor_model_parallel_size=2", "model.untie_embeddings_and_output_weights=false",
         "model.add_bias_linear=true", "model.kv_channels=16"]),
    (1, ["model.rope_scaling={rope_type: llama3, factor: 8, low_freq_factor: 1, high_freq_factor: 4, "
         "original_max_position_embeddings: 16}"]),
    (1, ["model.rope_scaling={rope_type: yarn, factor: 4, original_max_position_embeddings: 8}"]),
], ids=["tp1-gqa", "tp2-gqa", "tp2-tied-bias-headdim16", "rope-llama3", "rope-yarn"])
def test_exported_model_gives_the_framework_logits(tmp_path, world, extra):
    out, model, _ = _export_and_compare(tmp_path, world, extra)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["vocab_size"] == 250 and model.config.vocab_size == 250  # padding rows (to 256) dropped
    assert model.config.tie_word_embeddings == ("model.untie_embeddings_and_output_weights=false" in extra)


def test_sharded_bf16_export_with_padded_vocab(tmp_path):
    out, model, logits = _export_and_compare(tmp_path, 1, [], keep_padded_vocab=True, max_shard_size="100KB")
    assert model.config.vocab_size == 256
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert len(set(index["weight_map"].values())) > 1
    convert_to_hf.convert(str(tmp_path / "ck"), str(tmp_path / "bf16"), dtype="bfloat16")
    bf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert next(bf.parameters()).dtype == torch.bfloat16


def test_tokenizer_is_copied_with_its_special_ids(tmp_path):
    """The SentencePiece model lands as tokenizer.model, bos/eos ids in config.json. (Loading it through
    transformers.AutoTokenizer is not checked here: this venv's protobuf is older than transformers' generated
    sentencepiece proto, so transformers cannot read any SentencePiece model on this machine.)"""
    import sentencepiece as spm

    from megatron_lc.data.tokenizer import train_sentencepiece

    text = tmp_path / "t.txt"
    text.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(300)))
    model = train_sentencepiece([str(text)], str(tmp_path / "sp"), 300)
    ck, out = str(tmp_path / "ck"), str(tmp_path / "hf")
    run_dist(1, dist_cases_export.train_and_logits, TRAIN + [f"checkpoint.save={ck}", "train.train_iters=1"],
             torch.zeros(1, 4, dtype=torch.long))
    convert_to_hf.convert(ck, out, tokenizer=model)
    sp = spm.SentencePieceProcessor()
    sp.Load(os.path.join(out, "tokenizer.model"))
    assert sp.EncodeAsIds("def f3(x):") and sp.GetPieceSize() == 300
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (2, 3)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)["eos_token"] == "</s>"


def test_non_llama_checkpoint_is_refused(tmp_path, capsys):
    ck = str(tmp_path / "ck")
    run_dist(1, dist_cases_export.train_and_logits,
             TRAIN + [f"checkpoint.save={ck}", "model.normalization=LayerNorm", "train.train_iters=1"],
             torch.zeros(1, 4, dtype=torch.long))
    assert convert_to_hf.main([ck, str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: no Hugging Face family this exporter writes fits the model (LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, "
        "MixtralForCausalLM); the nearest, LlamaForCausalLM, cannot say "
        "model.normalization=LayerNorm")


@pytest.mark.skipif(importlib.util.find_spec("ortools") is not None,
                    reason="the planning extra (OR-Tools) pins protobuf < 6.34, older than transformers' "
                           "SentencePiece proto needs: a known conflict of that extra")
def test_exported_tokenizer_loads_in_transformers(tmp_path):
    """The copied SentencePiece model loads with ``AutoTokenizer`` (the default install carries a protobuf that
    transformers accepts; OR-Tools is an extra) and encodes like the framework's tokenizer."""
    from megatron_lc.data.tokenizer import SentencePieceTokenizer, train_sentencepiece

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + 'hello world'" for i in range(3000)))
    model = train_sentencepiece([str(corpus)], str(tmp_path / "sp"), 300)
    out = tmp_path / "hf"
    out.mkdir()
    convert_to_hf.copy_tokenizer(model, str(out))
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def g(y):\n    return y * 7 + 'hello'"
    ids = tok(text)["input_ids"]
    assert ids == SentencePieceTokenizer(model).encode(text) and tok.decode(ids) == text
