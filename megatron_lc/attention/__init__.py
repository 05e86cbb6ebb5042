"""Core attention implementations; ``build_core_attention`` picks one for the config and topology."""
from __future__ import annotations

from torch import nn

from ..config import Config, ConfigError
from ..parallel.topology import Topology
from .local import LocalCausalAttention


def build_core_attention(cfg: Config, topo: Topology, layer_number: int) -> nn.Module:
    """cp == 1: local attention. cp > 1: the ``parallel.cp_comm_type`` implementation."""
    if topo.cp == 1:
        return LocalCausalAttention()
    raise ConfigError(f"parallel.cp_comm_type {cfg.parallel.cp_comm_type} with cp={topo.cp} is not implemented yet")
