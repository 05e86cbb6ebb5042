"""Rank functions for tests/hf/test_families.py: the tiny model of each Hugging Face family (its ``model:`` section as
the importer writes it) under a layout, through the real setup and loop: the first step's full gradients and 2 steps'
losses, for the single-process model's. Every case of every family runs in one spawn; a failure names its case."""
from __future__ import annotations

import os
import tempfile

import torch
import yaml

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from megatron_lc.training.optimizer import sync_gradients
from tests.dist_cases.fsdp import full_grad
from tests.support.parity import assert_close_grads

STEPS = 2
TRAIN = ["data.seq_length=32", "data.mock_data=true", "train.device=cpu", f"train.train_iters={STEPS}",
         "train.global_batch_size=2", "train.lr=1e-3", "train.lr_warmup_iters=0", "logging.log_interval=100",
         "checkpoint.save=null"]
# name -> the layout's overrides (world 2 each); micro-batches fill the global batch of 2 on each dp rank
LAYOUTS = {
    "ring": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "train.micro_batch_size=2"],
    # one kv head: fewer than the Ulysses ranks, so each is copied (config.layout.kv_replication)
    "ulysses": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a", "model.num_query_groups=1",
                "train.micro_batch_size=2"],
    "fpdt": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=16",
             "memory.fpdt_offload=true", "train.micro_batch_size=2"],
    "tp2+sp": ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
               "train.micro_batch_size=2"],
    "fsdp2": ["parallel.use_torch_fsdp2=true", "train.micro_batch_size=1"],
}
# name -> a memory technique's overrides (world 2 each), with a layout under it: Memo's token-wise re-run and swap with
# MsT's mini-sequences (dp 2), host checkpoints under ring cp 2
TECHNIQUES = {
    "memo+mst": ["memory.activation_offload=memo", "memory.offload_fraction=0.25", "memory.mst=true",
                 "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4", "train.micro_batch_size=1"],
    "ring+host-checkpoints": ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p",
                              "memory.activation_offload=checkpoints", "train.micro_batch_size=2"],
}
# what a layout changes in the model itself: the single-process reference has it too
MODEL_CHANGES = ("model.", "data.reset", "data.eod", "data.mean_document_length")


def reference_overrides(overrides: list) -> list:
    """The overrides of a case that its single-process reference shares (the model's, the documents')."""
    return [o for o in overrides if o.startswith(MODEL_CHANGES)] + ["train.micro_batch_size=2"]


def _trainer(model: dict, overrides: list, world: int, topos: dict, tmp: str) -> Trainer:
    """A ``Trainer`` of the model section ``model`` under ``overrides`` on ``world`` ranks (1: this process;
    topologies cached in ``topos`` by (tp, cp, ulysses, ep))."""
    path = os.path.join(tmp, "model.yaml")
    with open(path, "w") as f:
        yaml.safe_dump({"model": model}, f)
    cfg = load_config(path, TRAIN + list(overrides) + [f"logging.metrics_file={os.path.join(tmp, 'm.jsonl')}",
                                                        "train.clip_grad=0"])
    layout = resolve_layout(cfg, world)
    key = (layout.tp, layout.cp, layout.ulysses, layout.ep)
    if key not in topos:
        topos[key] = (Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, ep=layout.ep) if world > 1
                      else Topology())
    return Trainer(cfg, topos[key], layout=layout)


def run_case(rank: int, model: dict, overrides: list, world: int, topos: dict) -> dict:
    """``{"grads": the full gradients of the first step (rank 0; FSDP2 shards gathered, tp pieces merged),
    "losses": STEPS steps' losses}`` of the model section ``model`` under ``overrides`` on ``world`` ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        t = _trainer(model, overrides, world, topos, tmp)
        t.optimizer.zero_grad(set_to_none=True)
        t.forward_backward(t.microbatches(0))
        sync_gradients(t.model, t.topo)
        grads = {n: full_grad(p, t.topo) for n, p in t.model.named_parameters()}
        losses = t.train().losses  # from step 0: its gradients zeroed first, nothing updated yet
    return {"grads": grads if rank == 0 else None, "losses": losses}


def train_cases(rank, world, cases: list) -> dict:
    """``{case name: run_case(...)}`` of every (name, model section, overrides) in ``cases`` on ``world`` ranks
    (1: this process), in one thread (tiny tensors)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    topos: dict = {}
    out = {}
    try:
        for name, model, overrides in cases:
            try:
                out[name] = run_case(rank, model, overrides, world, topos)
            except Exception as e:  # noqa: BLE001 - named with its case
                raise RuntimeError(f"case {name}: {type(e).__name__}: {e}") from e
    finally:
        torch.set_num_threads(threads)
    return out


def check_as_one_process(cases: list, got: list) -> None:
    """Every case's first-step gradients (rank 0's, full) within 1e-4 of the one-process model's and each rank's
    losses within 1e-5 relative (``reference_overrides``: what the one process shares with the case); a failure
    names its case."""
    refs = train_cases(0, 1, [(name, model, reference_overrides(over)) for name, model, over in cases])
    for name, _, _ in cases:
        ref = refs[name]
        try:
            assert_close_grads(got[0][name]["grads"], ref["grads"])
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        for r, ranks in enumerate(got):
            for step, (a, b) in enumerate(zip(ranks[name]["losses"], ref["losses"]), 1):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} rank {r} step {step}: {a!r} vs one process {b!r}"
