"""The Hugging Face families the importer takes -- Llama, Qwen2 / 2.5, Qwen3, Mistral, Gemma 3 (text) -- each a
random tiny transformers model built here from its config class (tests/support/hf_families.py; nothing is downloaded):

* ``tools/convert_from_hf.py --verify``: transformers' logits and ours on a seeded random batch, fp32 on the CPU,
  within 1e-4 of the largest logit (the script's own limit). Both sides compute the same function; they differ only
  in how sums are ordered (one fused QKV matmul vs three, SDPA on rectangles vs eager attention with a dense mask,
  RoPE frequencies from float64 vs float32, Gemma's query scale applied to q before the kernel instead of to the
  scores): ~1e-7 relative each, measured 2e-7 to 8e-7; a dropped norm, window or scale is 1e-2 or more.
* HF -> ours (at tp 2) -> HF: every tensor bit for bit, the same architecture, and transformers loads the export.
* Training under ring cp 2, Ulysses cp 2 with one kv head (fewer than its ranks), FPDT cp 2 with offload, tp 2
  with sequence parallelism, and FSDP2 gives the single-process model's first-step gradients, every one within
  1e-4 (tests/support/parity.py; the norm and bias gradients are ~1e-3, so a q/k norm weight not summed over tp or
  a bias shard misplaced is seen), and its loss at both of 2 steps within 1e-5 relative (the layouts only
  re-associate fp32 sums, ~1e-7 per op). Mistral's window of 4 is
  below a ring block (8 tokens of 32 at cp 2) and one of 12 above it; Gemma 3 has two local layers (window 4,
  its own RoPE base) and a global one; Qwen3 and Gemma 3 also with packed documents.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_lc.hf import import_hf, model_section_from_hf
from tests.dist_cases import families as df
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads
from tests.support.hf_families import ARCHITECTURES, FAMILIES, family_configs, save_hf_model

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import convert_from_hf  # noqa: E402
import convert_to_hf  # noqa: E402

DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
        "data.mean_document_length=12"]


@pytest.mark.parametrize("name", FAMILIES)
def test_import_verify_and_export_bit_for_bit(tmp_path, name, capsys):
    save_hf_model(name, tmp_path / "hf")
    assert convert_from_hf.main([str(tmp_path / "hf"), str(tmp_path / "ours"), "--tp", "2", "--verify"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("verify: max |logits - transformers' logits| = ") and line.endswith(": ok"), line
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
    else) and every layout, and the window and document cases."""
    out = [(f"{name}/{layout}", _section(name), over) for name in FAMILIES if name != "llama"
           for layout, over in df.LAYOUTS.items()]
    out.append(("mistral/ring/window-12", _section("mistral"), df.LAYOUTS["ring"] + ["model.sliding_window=12"]))
    out += [(f"{name}/ring/documents", _section(name), df.LAYOUTS["ring"] + DOCS) for name in ("qwen3", "gemma3")]
    return out


def test_every_family_trains_under_every_layout_as_one_process():
    cases = _cases()
    got = run_dist(2, df.train_cases, cases)
    refs = df.train_cases(0, 1, [(name, model, df.reference_overrides(over)) for name, model, over in cases])
    for name, _, _ in cases:
        ref = refs[name]
        try:
            assert_close_grads(got[0][name]["grads"], ref["grads"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        for r, ranks in enumerate(got):
            for step, (a, b) in enumerate(zip(ranks[name]["losses"], ref["losses"]), 1):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} rank {r} step {step}: {a!r} vs one process {b!r}"
