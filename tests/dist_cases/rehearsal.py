"""Processes of tests/rehearsal/test_rehearsal.py: rehearsals run in a fresh process each (the fake process group, the
fake-tensor mode and the stand-in device are process-wide)."""
from __future__ import annotations

import os

import torch

from megatron_lc.config import load_config
from megatron_lc.device import has_values
from megatron_lc.memory import checkpoint_offload
from megatron_lc.parallel.topology import Topology
from megatron_lc.rehearsal.rank import rehearsal_config, rehearse_rank
from megatron_lc.training.checkpointing import save
from megatron_lc.training.loop import Trainer

TINY = "configs/tiny_cpu.yaml"
# the tiny model on 8 simulated ranks (1 sample per step on every layout: global batch 1 x dp)
EIGHT = ["train.micro_batch_size=1", "train.global_batch_size=1", "data.seq_length=256"]
FAMILIES = {
    "ring": ["parallel.context_parallel_size=8", "parallel.cp_comm_type=p2p"],
    "ulysses": ["parallel.context_parallel_size=8", "parallel.cp_comm_type=a2a", "parallel.ulysses_size=8"],
    "hybrid": ["parallel.context_parallel_size=8", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"],
    "fpdt-offload": ["parallel.context_parallel_size=8", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=64",
                     "memory.fpdt_offload=true"],
    "tp2-sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
               "parallel.context_parallel_size=4"],
    "memo": ["parallel.context_parallel_size=8", "memory.activation_offload=memo", "memory.offload_fraction=0.25"],
    "mst": ["parallel.context_parallel_size=8", "memory.mst=true"],
    "fsdp2": ["parallel.context_parallel_size=8", "parallel.use_torch_fsdp2=true", "train.bf16=true"],
    "fsdp2-offload": ["parallel.context_parallel_size=8", "parallel.use_torch_fsdp2=true",
                      "parallel.fsdp_cpu_offload=true"],
    "tp2-fsdp2-offload": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                          "parallel.context_parallel_size=4", "parallel.use_torch_fsdp2=true",
                          "parallel.fsdp_cpu_offload=true", "train.bf16=true"],
    "ckpt-chunks": ["parallel.context_parallel_size=8", "memory.activation_offload=checkpoints",
                    "memory.layer_chunk_size=8"],
}


def plain_model(overrides: list):
    """The tiny model under ``overrides``, plain, on one process (its parameters' sizes)."""
    from megatron_lc.compose import build_model
    from megatron_lc.config import resolve_layout

    cfg = load_config(TINY, overrides)
    return build_model(cfg, resolve_layout(cfg, 1), Topology())[0]


def rehearse_families(rank, world, names, ranks=(0, 7), steps=2) -> dict:
    """Every family of ``names`` on 8 simulated ranks: the figures of ``ranks``."""
    out = {}
    for name in names:
        cfg = rehearsal_config(load_config(TINY, EIGHT + FAMILIES[name]), steps, 100.0)
        out[name] = {r: rehearse_rank(cfg, r, 8, 8, steps) for r in ranks}
    return out


def _host_copy_never_fetched(monkeypatch_target=checkpoint_offload.CheckpointOffload):
    """The planted fault: a layer's re-run reads its input's host copy in place of a device copy."""
    fetch = monkeypatch_target.fetch

    def fetch_host(self, layer):
        d = fetch(self, layer)
        return self.pool.data[:d.numel() * d.element_size()].view(d.dtype).view(d.shape)

    monkeypatch_target.fetch = fetch_host


def host_math_fault(rank, world) -> dict:
    """The host checkpoints mode with a layer re-run from the host copy: the rehearsal's violations, and the loss of
    an ordinary CPU step with and without the fault (host and device are one memory there: it trains the same)."""
    sets = ["memory.activation_offload=checkpoints", "train.train_iters=1", "checkpoint.save=null",
            "data.mock_data=true", "train.micro_batch_size=1", "train.global_batch_size=1"]

    def cpu_loss():
        torch.manual_seed(0)
        return Trainer(load_config(TINY, sets), Topology()).train().losses[0]

    clean = cpu_loss()
    clean_rehearsal = rehearse_rank(rehearsal_config(load_config(TINY, sets), 1, 100.0), 0, 1, 1, 1)["violations"]
    _host_copy_never_fetched()
    faulty = cpu_loss()
    report = rehearse_rank(rehearsal_config(load_config(TINY, sets), 1, 100.0), 0, 1, 1, 1)["violations"]
    return {"clean": clean, "faulty": faulty, "clean_rehearsal": clean_rehearsal, "violations": report}


def rehearsal_vs_real(rank, world, names) -> dict:
    """Calibration cases of the estimator (``tests/support/estimate_cases.py``) at one rank: the tracker's peak of the
    real
    CPU run and of its rehearsal (fake tensors, the fake process group, the same CPU execution), device and host
    together (on the CPU one memory)."""
    import tempfile

    from megatron_lc.config import resolve_execution
    from megatron_lc.estimate.measure import measure_training_peak
    from tests.support import estimate_cases

    cases = {c[0]: c[2] for c in estimate_cases.CASES}
    out = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = rehearsal_config(load_config(TINY, estimate_cases.base_overrides(tmp) + cases[name]), 2, 100.0)
        real = measure_training_peak(cfg, Topology(), steps=2)["peak_bytes"]
        fake = rehearse_rank(cfg, 0, 1, 1, 2, execution=resolve_execution(cfg, torch.device("cpu")))
        out[name] = {"real": real, "rehearsed": fake["total_peak_bytes"], "violations": fake["violations"]}
    return out


def rehearse_job(rank, world, names) -> dict:
    """Every family of ``names`` on 8 simulated ranks, rank 7, with the job after 2 steps: validation, a save, an
    async save, a resume and the step after it (the checkpoint in a temporary directory)."""
    import tempfile

    out = {}
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            cfg = rehearsal_config(load_config(TINY, EIGHT + FAMILIES[name]), 2, 100.0, save_dir=f"{d}/save")
            out[name] = rehearse_rank(cfg, 7, 8, 8, 2)
            out[name]["files"] = sorted(os.listdir(out[name]["checkpoint"]))
    return out


FINITE_CHECK = save.first_non_finite


def _stack_every_device(tensors: dict):
    """The save's finite check as it was: every tensor's sum in one stack, AdamW's host ``step`` counts with the
    device's sums (``torch.stack`` of two devices raises on CUDA)."""
    sums = torch.stack([t.to_local().sum() if hasattr(t, "to_local") else t.sum() for t in tensors.values()])
    return FINITE_CHECK(tensors) if has_values(sums) else None


def planted_save_bug(rank, world, planted: bool) -> dict:
    """The fsdp2 family's job on rank 0 with the old finite check put back (``planted``): where the rehearsal stops
    and what it reports."""
    import tempfile

    if planted:
        save.first_non_finite = _stack_every_device
    with tempfile.TemporaryDirectory() as d:
        cfg = rehearsal_config(load_config(TINY, EIGHT + FAMILIES["fsdp2"]), 2, 100.0, save_dir=f"{d}/save")
        r = rehearse_rank(cfg, 0, 8, 8, 2)
    return {k: r[k] for k in ("stopped", "violations", "job")}
