"""Core attention implementations; ``build_core_attention`` picks one for the config and topology.

    cp == 1                 LocalCausalAttention (SDPA on the whole sequence)
    cp_comm_type p2p        RingAttention over the ring axis (= cp), zigzag layout          (ring.py)
    cp_comm_type a2a        UlyssesAttention over the ulysses axis (= cp), contiguous layout (ulysses.py)
    cp_comm_type a2a+p2p    UlyssesAttention (ulysses_size) around RingAttention (cp / ulysses_size)
    cp_comm_type fpdt       chunked Ulysses with offload (separate module, not in this dispatch yet)

Each layer's module records the bytes it sends in ``topo.comm`` under the tag ``layer{n}.attn``."""
from __future__ import annotations

from torch import nn

from ..config import Config, ConfigError
from ..parallel.topology import Topology
from .local import LocalCausalAttention


def build_core_attention(cfg: Config, topo: Topology, layer_number: int) -> nn.Module:
    """cp == 1: local attention. cp > 1: the ``parallel.cp_comm_type`` implementation."""
    if topo.cp == 1:
        return LocalCausalAttention()
    p, m = cfg.parallel, cfg.model
    kind = p.cp_comm_type
    if p.context_parallel_size != topo.cp or p.ulysses_size != topo.ulysses:
        raise ConfigError(f"topology cp={topo.cp} (ulysses {topo.ulysses}) does not match the config "
                          f"(context_parallel_size {p.context_parallel_size}, ulysses_size {p.ulysses_size})")
    tag = f"layer{layer_number}.attn"
    backend = p.attention_backend
    if kind in ("p2p", "a2a", "a2a+p2p"):
        from .ring import RingAttention
        from .ulysses import UlyssesAttention

        ring = RingAttention(topo, backend=backend, tag=tag)  # ring of size 1 = local causal attention
        if topo.ulysses == 1:
            return ring
        return UlyssesAttention(topo, ring, m.num_attention_heads // topo.tp, m.num_query_groups // topo.tp, tag=tag)
    raise ConfigError(f"parallel.cp_comm_type {kind} with cp={topo.cp} is not implemented yet")
