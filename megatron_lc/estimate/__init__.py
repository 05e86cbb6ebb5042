"""Memory and time model for GPU-scale planning: "will 1M tokens fit on my 8 GPUs, and with which layout?"

    from megatron_lc.estimate import estimate, load_hardware
    est = estimate(cfg, load_hardware("h100"), world_size=8)
    est.memory.peak, est.memory.status, est.time.step_seconds, est.time.mfu

``layout_search.search_layouts`` enumerates tp x cp x ulysses x memory features and ranks the layouts that fit;
``tools/estimate.py`` is the command line. Formulas and their calibration: docs/estimator.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..config import Config, resolve_layout, resolve_techniques
from .hardware import HardwareProfile, load_hardware
from .dims import Dims
from .memory_estimate import MemoryEstimate, estimate_memory
from .states import dims_for
from .terms import terms_for
from .time_estimate import TimeEstimate, attention_kernel, estimate_time

__all__ = ["Estimate", "estimate", "load_hardware", "HardwareProfile", "Dims"]


@dataclass
class Estimate:
    cfg: Config
    hw: HardwareProfile
    dims: Dims
    memory: MemoryEstimate
    time: TimeEstimate
    states: str = "framework"  # the model-state accounting it was made with (states.py)
    backend_named: str = "auto"  # parallel.attention_backend as the config named it (``cfg`` holds the resolved one)

    @property
    def status(self) -> str:
        return self.memory.status


def estimate(cfg: Config, hw: HardwareProfile, world_size: int,
             activation_peak_override: Optional[float] = None, states: str = "framework",
             recompute_style: str = "token_wise", expert_load: Optional[float] = None) -> Estimate:
    """Memory and time of ``cfg`` on ``world_size`` ranks of ``hw`` (device ``hw.device``: fp32 on CPU, bf16 autocast
    on CUDA when ``train.bf16``). ``states``: ``framework`` (this trainer) or a what-if preset of ``states.py``;
    ``recompute_style``: ``token_wise`` (this trainer) or the what-if ``checkpoint`` (``terms/classic_checkpoint.py``);
    ``expert_load``: under expert parallelism the busiest expert rank's rows over its fair share (None:
    ``config.moe.EXPERT_LOAD``). Raises ConfigError for a layout the framework would refuse."""
    layout = resolve_layout(cfg, world_size)
    terms = terms_for(resolve_techniques(cfg, layout), recompute_style)
    dims = dims_for(Dims.from_config(cfg, layout, hw.device), states)
    if expert_load is not None and dims.ep > 1:
        dims = dataclasses.replace(dims, expert_load=expert_load)
    named, backend = cfg.parallel.attention_backend, attention_kernel(cfg, dims, hw)[0]
    if backend != named:  # auto: the backend a run picks on this GPU (its kernels' memory)
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, attention_backend=backend))
    t_layer = estimate_time(cfg, dims, hw, terms, alpha=None, states=states).t_layer_fwd
    mem = estimate_memory(cfg, dims, hw, terms, t_layer, activation_peak_override, states)
    tm = estimate_time(cfg, dims, hw, terms, mem.alpha, states=states)
    return Estimate(cfg, hw, dims, mem, tm, states, named)
