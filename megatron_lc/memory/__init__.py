"""Memory techniques applied to a built model (MsT, recompute/offload, planned arena)."""
from __future__ import annotations

from torch import nn

from ..config import Config, ConfigError
from ..parallel.topology import Topology


def apply_memory_features(model: nn.Module, cfg: Config, topo: Topology) -> nn.Module:
    """Wrap or replace the model's parts according to ``cfg.memory``; returns the model."""
    m = cfg.memory
    unsupported = []
    # --- memory.plan (issue 7): off | auto | plan.json; checked here, applied by the loop before step 1 ---------
    from .planning import check_plan_setting

    check_plan_setting(m.plan)
    # ---------------------------------------------------------------------------------------------------------
    if unsupported:
        raise ConfigError(f"not implemented yet: {', '.join(unsupported)}")
    # ---- MsT (issue 5): mini-sequence MLP and LM head + loss -------------------------------------------------
    if m.mst:
        from .mst import apply_mst

        model = apply_mst(model, cfg, topo)
    # ---- end MsT ---------------------------------------------------------------------------------------------
    # ---- recompute / Memo offload (issue 6, memory/memo.py): layer executors, profiler, alpha, rounding buffers.
    # After MsT, so the profiler measures the layers as they will run.
    from .memo import install_recompute

    install_recompute(model, cfg, topo)
    # ---- end recompute / Memo offload ------------------------------------------------------------------------
    return model
