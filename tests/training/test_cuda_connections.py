"""``CUDA_DEVICE_MAX_CONNECTIONS=1`` only where tensor-parallel overlap needs it (tp > 1), set by each rank before
its first CUDA call; with tp 1 it would serialise FSDP2's gathers and ring transfers behind long attention kernels
(``training/process_group.cuda_connections``). The image and the SLURM launcher no longer set it for every run."""
from __future__ import annotations

import os

import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.training import process_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=8", "model.ffn_hidden_size=96",
        "model.vocab_size=256", "data.seq_length=32", "data.mock_data=true", "train.device=cpu"]
KEY = "CUDA_DEVICE_MAX_CONNECTIONS"


def test_set_before_the_first_cuda_call_and_only_with_tp(monkeypatch, caplog):
    monkeypatch.delenv(KEY, raising=False)
    seen = []
    monkeypatch.setattr(process_group, "pick_device",
                        lambda cfg, local_rank: (seen.append(os.environ.get(KEY)), torch.device("cpu"))[1])
    process_group.init_distributed(load_config(None, TINY))
    assert seen == [None]  # tp 1: not set (the device was picked after the decision)
    process_group.cuda_connections(resolve_layout(load_config(None, TINY + [
        "parallel.tensor_model_parallel_size=2"]), 2))
    assert os.environ[KEY] == "1"
    monkeypatch.setenv(KEY, "8")  # the user's value is kept
    process_group.cuda_connections(resolve_layout(load_config(None, TINY + [
        "parallel.tensor_model_parallel_size=2"]), 2))
    assert os.environ[KEY] == "8"
    monkeypatch.setenv(KEY, "1")
    process_group.cuda_connections(resolve_layout(load_config(None, TINY), 1))
    assert os.environ[KEY] == "1" and "serialises FSDP2's gathers" in caplog.text  # kept, and said


def test_the_image_and_the_launcher_leave_it_to_the_ranks():
    for path in ("Dockerfile", "scripts/slurm/launch.sh"):
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        assert not [ln for ln in lines if KEY in ln and not ln.lstrip().startswith("#")], path
