"""Step-time cases of the time model on the framework's own CPU runs (``bench/estimate_calibration.py --time``): the
tiny model of ``configs/tiny_cpu.yaml`` under each technique, against a reference of the same rank count -- one
process: the plain model; 2 and 4 ranks: data parallel (each rank the plain model's work, the gradients
all-reduced). The machine is shared (2 cores, other jobs), so no absolute time is compared: the measured ratio
case / reference against the
estimator's ratio with the CPU profile (``configs/hardware/cpu.yaml``). The case and its reference run side by side in
one fresh process per measurement (``time_pair``: their steps in turn), so the load of the shared cores' other jobs
falls on both alike; the step is measured in CPU seconds of the rank's process (the work), wall seconds beside.

    ratio error = (estimated case / estimated reference) / (measured case / measured reference) - 1
"""
from __future__ import annotations

import os
import tempfile
import time

from tests.support.estimate_cases import ROOT, base_overrides

SEQ = ["data.seq_length=2048"]
# (id, ranks, overrides on top of base_overrides + SEQ): one line per technique
CASES = [
    ("plain", 1, []),
    ("recompute-full", 1, ["memory.recompute_granularity=full"]),
    ("recompute-selective", 1, ["memory.recompute_granularity=selective"]),
    ("memo-alpha0", 1, ["memory.activation_offload=memo", "memory.offload_fraction=0"]),
    ("memo-alpha0.5", 1, ["memory.activation_offload=memo", "memory.offload_fraction=0.5"]),
    ("host-checkpoints", 1, ["memory.activation_offload=checkpoints"]),
    ("host-checkpoints-chunks", 1, ["memory.activation_offload=checkpoints", "memory.layer_chunk_size=256"]),
    ("mst", 1, ["memory.mst=true", "memory.mst_mlp_chunk_size=256"]),
    ("fpdt-u4", 1, ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=512"]),
    ("dp2", 2, []),
    ("tp2-sp", 2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    ("ring-cp2", 2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"]),
    ("ulysses-cp2", 2, ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"]),
    ("dp2-zero1", 2, ["parallel.use_distributed_optimizer=true"]),
    ("dp2-fsdp2", 2, ["parallel.use_torch_fsdp2=true"]),
    ("dp4", 4, []),
    ("hybrid-cp4", 4, ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p",
                       "parallel.ulysses_size=2"]),
]
REFERENCE = {1: "plain", 2: "dp2", 4: "dp4"}  # the case each one is divided by, by rank count


def case_overrides(world: int, overrides: list) -> list:
    """The case's overrides: data parallel cases run one sample per rank (the reference's work per rank)."""
    dp = ["train.global_batch_size=" + str(world)] if not any(
        o.startswith(("parallel.tensor_model_parallel_size", "parallel.context_parallel_size")) for o in overrides) \
        else []
    return SEQ + dp + list(overrides)


def _trainer(overrides: list, tmp: str):
    import torch

    from megatron_lc.config import load_config
    from megatron_lc.parallel.topology import Topology
    from megatron_lc.training.loop import Trainer

    cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base_overrides(tmp) + list(overrides))
    cfg.train.train_iters = 1000
    p = cfg.parallel
    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size)
    return Trainer(cfg, topo, torch.device("cpu"))


def _step(trainer, i: int) -> tuple:
    """One training step of ``trainer``: (CPU seconds of this process -- its compute thread's and gloo's --, wall
    seconds)."""
    c0, t0 = time.process_time(), time.perf_counter()
    rec = trainer.train_step(i)
    trainer.state.consumed_samples = rec["consumed_samples"]
    return time.process_time() - c0, time.perf_counter() - t0


def time_pair(rank: int, world: int, reference: list, case: list, warmup: int = 1, pairs: int = 4) -> dict:
    """The reference's and the case's trainers side by side in this fresh process (one thread a rank), their steps
    in turn -- reference, case, reference, case, ... -- so that the shared cores' other jobs fall on both alike:
    after ``warmup`` steps of each, the median over ``pairs`` of case step / reference step, in CPU seconds (the work:
    other jobs stretch the wall time by up to 8x here, and by different amounts from one step to the next) and in
    wall seconds beside them."""
    import statistics

    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as t1, tempfile.TemporaryDirectory() as t2:
        ref, cas = _trainer(reference, t1), _trainer(case, t2)
        for i in range(warmup):
            _step(ref, i), _step(cas, i)
        r, c = [], []
        for i in range(warmup, warmup + pairs):
            r.append(_step(ref, i))
            c.append(_step(cas, i))
        ref.metrics.close(), cas.metrics.close()
    return {"rank": rank, "ratio": statistics.median(x[0] / y[0] for x, y in zip(c, r)),
            "wall_ratio": statistics.median(x[1] / y[1] for x, y in zip(c, r)),
            "reference_s": statistics.median(x[0] for x in r), "case_s": statistics.median(x[0] for x in c)}


# The CPU profile's own figures (configs/hardware/cpu.yaml: its fp32 peak and ``step_overhead_seconds``) are measured
# on the plain model alone, at two lengths, never on a technique's case: that is the calibration, every case above
# the validation.
PROFILE_LENGTHS = (512, 2048)


def fit_profile(measured: dict, estimated: dict) -> dict:
    """The plain model's steps at the two ``PROFILE_LENGTHS`` (``measured``: CPU seconds; ``estimated``: the
    estimator's step with the profile as it stands, without its step overhead) on a line, measured = scale x
    estimated + overhead: the estimator's compute is ``scale`` times too slow (so the fp32 peak is divided by it)
    and ``overhead`` seconds a step are the loop's host work that no FLOP count sees (Python, the data, the
    norm, AdamW as torch runs it beyond the optimizer term). Example: 0.408 s and 1.371 s measured where the
    estimator said 0.413 s and 2.361 s: scale 0.494, overhead 0.204 s."""
    short, long_ = PROFILE_LENGTHS
    scale = (measured[long_] - measured[short]) / (estimated[long_] - estimated[short])
    return {"scale": scale, "step_overhead_seconds": measured[short] - scale * estimated[short]}
