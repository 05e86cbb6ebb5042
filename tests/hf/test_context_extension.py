"""The context-extension recipe's CPU twin (configs/llama3_8b_extend/ at toy size, docs/context_extension.md):
a random tiny Hugging Face Llama -> import -> stage 1 at 512 tokens, tp=2 -> stage 2 at 2048 tokens, ring cp=2, a
higher RoPE base -> export -> transformers loads it and gives the logits of the stage-2 weights (loaded here at
cp=1: the same weights, the full sequence on one rank). Tolerance of the logits: tests/hf/test_hf_import.py."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.hf import import_hf
from tests.dist_cases import export as dist_cases_export
from tests.support.dist import run_dist
from tests.hf.test_hf_import import ATOL, TOKENS, hf_llama, hf_logits

transformers = pytest.importorskip("transformers")

STAGE = ["train.train_iters=2", "train.lr=1e-3", "train.lr_warmup_iters=0", "checkpoint.finetune=true",
         "train.micro_batch_size=1", "train.global_batch_size=2"]


def test_import_two_stages_export(tmp_path):
    import sys

    sys.path.insert(0, "tools")
    import convert_to_hf

    hf_llama(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "import"), tp=1)
    imp = str(tmp_path / "import")
    s1, _ = run_dist(2, dist_cases_export.imported_logits, imp, STAGE + [
        "parallel.tensor_model_parallel_size=2", "data.seq_length=512", "model.max_position_embeddings=512",
        f"checkpoint.save={tmp_path / 'stage1'}"], TOKENS)[0]
    s2, _ = run_dist(2, dist_cases_export.imported_logits, imp, STAGE + [
        "parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p",
        "data.seq_length=2048", "model.max_position_embeddings=2048", "model.rotary_base=50000",
        f"checkpoint.load={tmp_path / 'stage1'}", f"checkpoint.save={tmp_path / 'stage2'}"], TOKENS)[0]
    assert len(s1) == len(s2) == 2 and all(torch.isfinite(torch.tensor(s1 + s2)))
    # the stage-2 weights at cp=1 (loaded, not trained) vs transformers on the export
    _, ours = run_dist(1, dist_cases_export.imported_logits, imp, [
        "data.seq_length=2048", "model.max_position_embeddings=2048", "model.rotary_base=50000",
        "train.train_iters=2", f"checkpoint.load={tmp_path / 'stage2'}"], TOKENS)[0]
    convert_to_hf.convert(str(tmp_path / "stage2"), str(tmp_path / "export"))
    hf2 = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    assert hf2.config.max_position_embeddings == 2048 and hf2.config.rope_parameters["rope_theta"] == 50000
    err = (ours - hf_logits(hf2, TOKENS)).abs().max().item()
    assert err <= ATOL, f"max |ours - HF| logits after two stages = {err:.3e}"
    print("stage losses", s1, s2)
