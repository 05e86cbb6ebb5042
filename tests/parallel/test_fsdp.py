"""FSDP2 (``parallel.use_torch_fsdp2``): weights, gradients and AdamW states sharded over dp x cp, under our tp/SP,
with the memory techniques on top -- exact against the plain single-process model, resumable, and its checkpoints
load at any layout with or without FSDP.

Tolerances (fp32 on CPU): FSDP adds only a reduce-scatter in place of an all-reduce and the shard/gather copies,
so the gradients differ from the plain model's by the reduction order of the layouts (measured <= 1.1e-8 absolute,
the loss <= 4.3e-8 relative, the norm <= 4.3e-9 relative); asserted at the contract (grads 1e-4, loss 1e-5)."""
from __future__ import annotations

import pytest

from tests.dist_cases import fsdp as fsdp
from tests.support.dist import run_dist
from tests.support.parity import assert_close_grads, assert_close_loss

FSDP = ["parallel.use_torch_fsdp2=true"]
TIED = "model.untie_embeddings_and_output_weights=false"
# name -> (world, overrides); global batch 4 everywhere, so every case is the same optimisation problem
CASES = {
    "dp2": (2, ["train.micro_batch_size=2"]),
    "dp2-tied-head": (2, ["train.micro_batch_size=2", TIED]),  # one unit: the root
    "ring-cp2": (2, ["parallel.context_parallel_size=2", "train.micro_batch_size=4"]),
    "tp2-alone": (2, ["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=4"]),  # a 1-rank shard group
    "mst+memo": (2, ["memory.mst=true", "memory.mst_mlp_chunk_size=16", "memory.mst_head_chunks=4",
                     "memory.activation_offload=memo", "memory.offload_fraction=0.25", "train.micro_batch_size=2"]),
    "fpdt+offload": (2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                         "memory.fpdt_chunk_size=32", "memory.fpdt_offload=true", "train.micro_batch_size=4"]),
    "selective+accum": (2, ["memory.recompute_granularity=selective", "train.micro_batch_size=1"]),
    "tp2+sp-x-ring-cp2": (4, ["parallel.context_parallel_size=2", "parallel.tensor_model_parallel_size=2",
                              "parallel.sequence_parallel=true", "train.micro_batch_size=4"]),
    "ring-cp2-x-dp2-accum": (4, ["parallel.context_parallel_size=2", "train.micro_batch_size=1"]),
}


@pytest.fixture(scope="module")
def results():
    out = {"reference": fsdp.first_step_grads(0, 1, ["train.micro_batch_size=4"]),
           "reference-tied": fsdp.first_step_grads(0, 1, ["train.micro_batch_size=4", TIED])}
    for world in (2, 4):
        names = {n: FSDP + ov for n, (w, ov) in CASES.items() if w == world}
        out.update(run_dist(world, fsdp.grad_cases, names)[0])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp_gradients_equal_the_plain_model(results, case):
    ref, got = results["reference-tied" if TIED in CASES[case][1] else "reference"], results[case]
    assert got["sharded"] == len(ref["grads"]), "every parameter is an FSDP shard"
    assert_close_loss(got["loss"], ref["loss"])
    assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], (got["grad_norm"], ref["grad_norm"])
    assert_close_grads(got["grads"], ref["grads"])


TP2_DP2 = FSDP + ["parallel.tensor_model_parallel_size=2", "train.micro_batch_size=2", "train.train_iters=4",
                  "train.lr_decay_iters=4"]  # the schedule of the 4 steps, also in the 2-step first part


def test_fsdp_resume_is_exact_and_loads_without_fsdp(tmp_path):
    """tp2 x dp2 with FSDP: 2 steps, save, resume -> the straight 4 steps bit for bit; the same checkpoint (2-D
    shards: tp cuts rows or columns, FSDP the other dim) resumed at dp2 without FSDP continues within 1e-5."""
    straight = run_dist(4, fsdp.train, TP2_DP2)[0]
    ck = str(tmp_path / "ck")
    first = run_dist(4, fsdp.train, TP2_DP2 + ["train.train_iters=2", f"checkpoint.save={ck}"])[0]
    again = run_dist(4, fsdp.train, TP2_DP2 + [f"checkpoint.load={ck}"])[0]
    assert first + again == straight
    plain = run_dist(2, fsdp.train, ["train.micro_batch_size=2", "train.train_iters=4", f"checkpoint.load={ck}"])[0]
    for step, (a, b) in enumerate(zip(first + plain, straight), 1):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: {a!r} vs straight {b!r}"


def test_fsdp_refusals():
    from megatron_lc.config import ConfigError, load_config, resolve_layout

    for extra, keys in [(["parallel.use_distributed_optimizer=true"], ["use_torch_fsdp2", "use_distributed_optimizer"]),
                        (["parallel.use_torch_fsdp2=false", "parallel.fsdp_cpu_offload=true"],
                         ["fsdp_cpu_offload", "use_torch_fsdp2"])]:
        with pytest.raises(ConfigError) as e:
            resolve_layout(load_config(None, fsdp.TINY + FSDP + extra), 2)
        assert "\n" not in str(e.value) and all(k in str(e.value) for k in keys), str(e.value)


def test_one_process_fsdp2_with_cpu_offload_is_the_plain_model():
    """The one-GPU case: FSDP2 over a group of this process alone (started by the framework when no launcher did),
    states on the host; fp32, same data: the losses equal the plain model's bit for bit (nothing is re-associated)."""
    import torch.distributed as dist

    steps = ["train.micro_batch_size=4", "train.train_iters=2", "checkpoint.save=null"]
    assert not dist.is_initialized()
    try:
        assert fsdp.train(0, 1, FSDP + ["parallel.fsdp_cpu_offload=true"] + steps) == fsdp.train(0, 1, steps)
    finally:  # the group FSDP2 started for this process: gone before the next test
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp2_refuses_a_format2_checkpoint_in_one_line(tmp_path):
    """Checkpoints of the previous format (torch files per tp rank) are not read into FSDP2's shards: one line that
    says how to convert, before anything loads."""
    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer
    from tests.dist_cases import train as dist_cases_train

    plain = load_config(None, fsdp.TINY + ["train.micro_batch_size=4", "checkpoint.save=null"])
    full = {n: p.detach().clone() for n, p in Trainer(plain, Topology()).model.named_parameters()}
    dist_cases_train.write_format2(tmp_path / "iter_0000001", plain, full, tp=1)
    import torch.distributed as dist

    try:
        with pytest.raises(ConfigError) as e:
            Trainer(load_config(None, fsdp.TINY + FSDP + ["train.micro_batch_size=4", "checkpoint.save=null",
                                                          f"checkpoint.load={tmp_path}"]), Topology())
    finally:  # the group FSDP2 started for this process
        if dist.is_initialized():
            dist.destroy_process_group()
    msg = str(e.value)
    assert "\n" not in msg and "format 2" in msg and "use_torch_fsdp2" in msg, msg


def test_fsdp2_gathers_the_next_unit_as_the_current_one_starts(monkeypatch):
    """Forward order embedding -> layer 0 -> layer 1 -> head: as a unit's forward starts, its own weights and the
    next unit's are gathered, before its computation; in backward the previous unit's as each starts. Without the
    explicit prefetch, forward gathered a layer only when its own forward began (the host does not run ahead of a
    GPU that the memory techniques make it wait on)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    log: list = []
    unshard = FSDPParamGroup.unshard
    monkeypatch.setattr(FSDPParamGroup, "unshard", lambda self, async_op=False: (
        log.append(("gather", self.modules[0]._unit)), unshard(self, async_op))[1])
    try:
        trainer = Trainer(load_config(None, fsdp.TINY + FSDP + ["train.micro_batch_size=4", "train.train_iters=1",
                                                                "checkpoint.save=null"]), Topology())
        model = trainer.model
        units = {"embedding": model.embedding, "layer 0": model.layers[0], "layer 1": model.layers[1],
                 "head": model.head}
        for name, unit in units.items():
            unit._unit = name
            unit.register_forward_pre_hook(lambda m, a: log.append(("forward", m._unit)))
        model._unit = "root"
        log.clear()
        trainer.train()
    finally:  # the group FSDP2 started for this process
        if dist.is_initialized():
            dist.destroy_process_group()
    forward = log[:log.index(("forward", "head")) + 1]
    for a, b in (("embedding", "layer 0"), ("layer 0", "layer 1"), ("layer 1", "head")):  # b gathered before a runs
        assert forward.index(("gather", b)) < forward.index(("forward", a)), forward
    backward = list(dict.fromkeys(u for e, u in log[len(forward):] if e == "gather" and u != "root"))  # first ones
    assert backward[:3] == ["head", "layer 1", "layer 0"], log
