"""Export what was imported: a Hugging Face model of every family, imported, trained two steps (one process, mock
data: the run has no tokenizer directory) and exported, comes back with its ``config.json`` key for key and value for
value as it was (Qwen's ``max_window_layers`` of 28 over 2 layers, the one dtype field transformers 5 writes,
``transformers_version``, the null token ids) and its ``generation_config.json`` too, beside the trained weights; a
field the run changed is the one that differs."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import yaml

from megatron_lc.config import Config
from megatron_lc.hf import import_hf
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.support.hf_families import FAMILIES, save_hf_model

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "tools"))
import convert_to_hf  # noqa: E402


def _import_train_export(tmp_path, name: str, **model_changes) -> tuple:
    """(the original directory, the export's directory) after import -> 2 steps -> export."""
    hf, imp, run, out = (tmp_path / d for d in ("hf", "import", "run", "out"))
    save_hf_model(name, hf)
    import_hf(str(hf), str(imp))
    model = yaml.safe_load((imp / "model.yaml").read_text())["model"]
    cfg = Config.from_dict({
        "model": {**model, **model_changes}, "data": {"mock_data": True, "seq_length": 32},
        "train": {"train_iters": 2, "micro_batch_size": 2, "global_batch_size": 2, "lr": 1e-2, "device": "cpu"},
        "checkpoint": {"load": str(imp), "finetune": True, "save": str(run)}, "logging": {"peak_tflops": 1}})
    Trainer(cfg, Topology()).train()
    convert_to_hf.convert(str(run), str(out))
    return hf, out


def _json(path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", FAMILIES)
def test_an_imported_config_survives_training_and_export_key_for_key(tmp_path, name):
    hf, out = _import_train_export(tmp_path, name)
    assert _json(out / "config.json") == _json(hf / "config.json")
    assert _json(out / "generation_config.json") == _json(hf / "generation_config.json")
    before, after = load_file(str(hf / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys() and not all(torch.equal(before[k], after[k]) for k in before)  # trained


def test_what_the_run_changed_is_what_differs(tmp_path):
    """A longer context declared for the run (the first stage of an extension): max_position_embeddings alone."""
    hf, out = _import_train_export(tmp_path, "qwen3", max_position_embeddings=2048)
    before, after = _json(hf / "config.json"), _json(out / "config.json")
    assert {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)} == {"max_position_embeddings"}
    assert (before["max_position_embeddings"], after["max_position_embeddings"]) == (512, 2048)
