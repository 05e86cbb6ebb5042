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
    if m.recompute_granularity != "none":
        unsupported.append(f"memory.recompute_granularity={m.recompute_granularity}")
    if m.activation_offload != "none":
        unsupported.append(f"memory.activation_offload={m.activation_offload}")
    # --- memory.plan (issue 7): off | auto | plan.json; checked here, applied by the loop before step 1 ---------
    from .planning import check_plan_setting

    check_plan_setting(m.plan)
    # ---------------------------------------------------------------------------------------------------------
    if unsupported:
        raise ConfigError(f"not implemented yet: {', '.join(unsupported)}")
    return model
