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


# The CPU profile's own figures (configs/hardware/cpu.yaml: its fp32 peak, its attention kernel's efficiency and
# ``step_overhead_seconds``) are measured on the plain model alone, at four lengths, never on a technique's case: that
# is the calibration, every case above the validation. Measured in pairs, each pair in one fresh process:
PROFILE_PAIRS = ((4096, 1024), (2048, 512))
PROFILE_LENGTHS = tuple(sorted(n for pair in PROFILE_PAIRS for n in pair))  # 512, 1024, 2048, 4096


def fit_profile(measured: dict, parts: dict) -> dict:
    """The plain model's steps at the ``PROFILE_LENGTHS`` (``measured``: CPU seconds) as the estimator's parts with
    the profile as it stands (``parts``: length -> (linears and the rest, attention, optimizer) seconds, no step
    overhead), least squares over the lengths: measured = gemm x linears + attention x attention + optimizer +
    overhead. The linears grow with the tokens, the attention with their square, the overhead not at all, so four
    lengths tell the three apart: the estimator's linears are ``gemm`` times too slow (the fp32 peak is divided by
    it), its attention ``attention`` times (the kernel's efficiency is multiplied by gemm / attention), and
    ``overhead`` seconds a step are the loop's host work no FLOP count sees. Example: steps of 0.334, 0.695, 1.648,
    4.365 s where the estimator said (0.170, 0.032), (0.340, 0.127), (0.679, 0.506), (1.358, 2.025) s and 0.0136 s
    for the optimizer: gemm 1.563, attention 1.092, overhead 0.017 s."""
    import torch

    rows = [[parts[n][0], parts[n][1], 1.0] for n in PROFILE_LENGTHS]
    rhs = [[measured[n] - parts[n][2]] for n in PROFILE_LENGTHS]
    gemm, attention, overhead = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                                   torch.tensor(rhs, dtype=torch.float64)).solution.flatten().tolist()
    return {"gemm": gemm, "attention": attention, "step_overhead_seconds": overhead}
