"""Memory techniques applied to a built model (MsT, recompute/offload, planned arena)."""
from __future__ import annotations

from torch import nn

from ..config import Config, ConfigError
from ..parallel.topology import Topology


def apply_memory_features(model: nn.Module, cfg: Config, topo: Topology) -> nn.Module:
    """Wrap or replace the model's parts according to ``cfg.memory``; returns the model."""
    m = cfg.memory
    unsupported = []
    if m.mst:
        unsupported.append("memory.mst")
    if m.plan != "off":
        unsupported.append(f"memory.plan={m.plan}")
    if unsupported:
        raise ConfigError(f"not implemented yet: {', '.join(unsupported)}")
    # ---- recompute / Memo offload (memory/memo.py): layer executors, profiler, alpha, rounding buffers ----
    from .memo import install_recompute

    install_recompute(model, cfg, topo)
    # ---- end recompute / Memo offload ----
    return model
