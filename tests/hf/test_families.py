"""The Hugging Face families the importer takes -- Llama, Qwen2 / 2.5, Qwen3, Mistral, Gemma 3 (text) -- each a
random tiny transformers model built here from its config class (tests/support/hf_families.py; nothing is downloaded):

* ``tools/convert_from_hf.py --verify``: transformers' logits and ours on a seeded random batch, fp32 on the CPU,
  within 1e-4 of the largest logit (the script's own limit). Both sides compute the same function; they differ only
  in how sums are ordered (one fused QKV matmul vs three, SDPA on rectangles vs eager attention with a dense mask,
  RoPE frequencies from float64 vs float32, Gemma's query scale applied to q before the kernel instead of to the
  scores): ~1e-7 relative each, measured 2e-7 to 8e-7; a dropped norm, window or scale is 1e-2 or more.
* HF -> ours (at tp 2) -> HF: every tensor bit for bit, the same architecture, and transformers loads the export
  (the mixture-of-experts families too: tests/hf/test_moe_families.py says what else they check).
* Training under ring cp 2, Ulysses cp 2 with one kv head (fewer than its ranks), FPDT cp 2 with offload, tp 2
  with sequence parallelism, FSDP2, Memo (α 0.25) with MsT, and host checkpoints under ring cp 2 gives the
  single-process model's first-step gradients, every one within
  1e-4 (tests/support/parity.py; the norm and bias gradients are ~1e-3, so a q/k norm weight not summed over tp or
  a bias shard misplaced is seen), and its loss at both of 2 steps within 1e-5 relative (the layouts only
  re-associate fp32 sums, ~1e-7 per op). Mistral's window of 4 is
  below a ring block (8 tokens of 32 at cp 2) and one of 12 above it; Gemma 3 has two local layers (window 4,
  its own RoPE base) and a global one; Qwen3 and Gemma 3 also with packed documents.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from megatron_lc.hf import import_hf, model_section_from_hf
from tests.dist_cases import families as df
from tests.support.dist import run_dist
from tests.support.hf_families import ARCHITECTURES, FAMILIES, MOE_FAMILIES, family_configs, save_hf_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402

DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
        "data.mean_document_length=12"]


@pytest.mark.parametrize("name", FAMILIES + MOE_FAMILIES)
def test_import_verify_and_export_bit_for_bit(tmp_path, name, capsys):
    """(The mixture-of-experts families' --verify also compares every MoE layer's router logits and Hugging Face's
    load-balancing loss: a second line.)"""
    save_hf_model(name, tmp_path / "hf")
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "ours"), "--tp", "2", "--verify"]) == 0
    lines = [x for x in capsys.readouterr().out.strip().splitlines() if x.startswith("verify: ")]
    assert lines[0].startswith("verify: max |logits - transformers' logits| = ") and lines[0].endswith(": ok"), lines
    if name in MOE_FAMILIES:
        assert lines[1].startswith("verify: max |router logits - transformers'| = ") and lines[1].endswith(": ok")
    assert len(lines) == 1 + (name in MOE_FAMILIES), lines
    convert_to_hf.convert(str(tmp_path / "ours"), str(tmp_path / "back"))
    back, ref = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("back", "hf"))
    assert back.keys() == ref.keys()
    for k in ref:
        assert torch.equal(back[k], ref[k]), k
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["architectures"] == [ARCHITECTURES[name]]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), dtype=torch.float32)
    assert type(reloaded).__name__ == ARCHITECTURES[name]


def _section(name: str, **changes) -> dict:
    cls, kwargs = family_configs(transformers)[name]
    return model_section_from_hf({**cls(**{**kwargs, **changes}).to_dict(), "architectures": [ARCHITECTURES[name]]})


def _cases() -> list:
    """(case name, model section, overrides) for every family but Llama (the framework's own, tested everywhere
    else) and every layout and memory technique, and the window and document cases."""
    out = [(f"{name}/{layout}", _section(name), over) for name in FAMILIES if name != "llama"
           for layout, over in df.LAYOUTS.items()]
    out += [(f"{name}/{t}", _section(name), over) for name in FAMILIES if name != "llama"
            for t, over in df.TECHNIQUES.items()]
    out.append(("mistral/ring/window-12", _section("mistral"), df.LAYOUTS["ring"] + ["model.sliding_window=12"]))
    out += [(f"{name}/ring/documents", _section(name), df.LAYOUTS["ring"] + DOCS) for name in ("qwen3", "gemma3")]
    return out


def test_every_family_trains_under_every_layout_as_one_process():
    cases = _cases()
    df.check_as_one_process(cases, run_dist(2, df.train_cases, cases))


@pytest.mark.parametrize("name,change,message", [
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 (not implemented)"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 (not implemented)"),
    ("qwen3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 (not implemented)"),
    ("qwen2", {"num_experts": 8}, "num_experts=8 (not implemented)"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True (a bias on o_proj without one on the MLP)"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu' (only silu)"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention of type linear (the local layers take a plain RoPE theta only)"),
])
def test_what_a_family_does_not_implement_is_one_line(tmp_path, name, change, message, capsys):
    """Exit 2, one line on stderr, nothing written (the script's own process: tests/hf/test_hf_import.py)."""
    save_hf_model(name, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
    capsys.readouterr()  # transformers' progress bars of the save
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: cannot import this Hugging Face model: {message}\n"
    assert not os.path.exists(tmp_path / "o")


def test_tokenizer_files_and_chat_template_round_trip_byte_for_byte(tmp_path):
    """The import copies the tokenizer files as they are (the chat template in tokenizer_config.json and in
    chat_template.jinja); the export of a run whose tokenizer is that directory writes the same bytes."""
    from tests.support.data_util import llama3_tokenizer

    hf = tmp_path / "hf"
    llama3_tokenizer(hf, 300)
    tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    (hf / "tokenizer_config.json").write_text(json.dumps({**tok_cfg, "chat_template": template}, indent=3))
    (hf / "chat_template.jinja").write_text(template + "\n")
    save_hf_model("qwen3", hf, vocab_size=300)
    import_hf(str(hf), str(tmp_path / "ours"))
    convert_to_hf.convert(str(tmp_path / "ours"), str(tmp_path / "back"), tokenizer=str(tmp_path / "ours"))
    names = [n for n in os.listdir(hf) if n.startswith(("tokenizer", "special_tokens", "chat_template"))]
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(names)
    for n in names:
        assert (tmp_path / "ours" / n).read_bytes() == (hf / n).read_bytes(), n
        assert (tmp_path / "back" / n).read_bytes() == (hf / n).read_bytes(), n
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi"
