"""Rank functions for the estimator's calibration (run by ``tests.dist.run_dist`` in fresh processes)."""
from __future__ import annotations

import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def base_overrides(metrics_dir: str) -> list[str]:
    """The tiny model of ``configs/tiny_cpu.yaml`` on random tokens, no checkpoints, one micro-batch per rank."""
    return ["data.mock_data=true", "data.prepare_demo_data=false", "checkpoint.save=null", "train.device=cpu",
            "data.seq_length=512", "train.micro_batch_size=1", "train.global_batch_size=null", "logging.log_interval=100",
            f"logging.metrics_file={os.path.join(metrics_dir, 'metrics.jsonl')}"]


def measure_case(rank: int, world: int, overrides: list) -> dict:
    """This rank's measured peak live bytes over 2 training steps of the framework (see estimate/measure.py)."""
    import torch

    from megatron_lc.config import load_config
    from megatron_lc.estimate.measure import measure_training_peak
    from megatron_lc.parallel.topology import Topology

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base_overrides(tmp) + list(overrides))
        p = cfg.parallel
        topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size)
        out = measure_training_peak(cfg, topo, steps=2)
    out["rank"] = rank
    return out
