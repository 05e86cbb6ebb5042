"""Core attention (``core.py``: the protocol) and its implementations; ``build_core_attention`` picks one for the
layout. FPDT, an attention block rather than a core attention, is in ``fpdt/``.

    cp == 1                 LocalCausalAttention (one kernel on the whole local sequence)             (local.py)
    cp_comm_type p2p        RingAttention over the ring axis (= cp), zigzag or balanced layout          (ring.py)
    cp_comm_type a2a        UlyssesAttention over the ulysses axis (= cp), contiguous layout         (ulysses.py)
    cp_comm_type a2a+p2p    UlyssesAttention (ulysses_size) around RingAttention (cp / ulysses_size)

Each layer's module records the bytes it sends in ``topo.comm`` under the tag ``layer{n}.attn``; its causal sliding
window is the layout's for layer n (``Layout.window``), given when it is built."""
from __future__ import annotations

from ..config import ConfigError, Layout
from ..parallel.topology import Topology
from .core import CoreAttention
from .local import LocalCausalAttention
from .ring import RingAttention
from .ulysses import UlyssesAttention

__all__ = ["CoreAttention", "LocalCausalAttention", "RingAttention", "UlyssesAttention", "build_core_attention"]


def build_core_attention(layout: Layout, topo: Topology, backend, layer_number: int) -> CoreAttention:
    """cp == 1: local attention. cp > 1: the layout's ``cp_comm_type`` implementation. ``backend``: a
    ``parallel.attention_backend`` name or the model's ``backends.Kernels``."""
    if layout.cp != topo.cp or layout.ulysses != topo.ulysses:
        raise ConfigError(f"topology cp={topo.cp} (ulysses {topo.ulysses}) does not match the layout "
                          f"(cp {layout.cp}, ulysses {layout.ulysses})")
    window = layout.window(layer_number)  # the layer's own (model.sliding_window, model.layer_types)
    if topo.cp == 1:
        return LocalCausalAttention(backend, window)
    if layout.cp_comm_type not in ("p2p", "a2a", "a2a+p2p"):
        raise ConfigError(f"parallel.cp_comm_type {layout.cp_comm_type} has no core attention (FPDT replaces the "
                          f"attention block)")
    tag = f"layer{layer_number}.attn"
    # ring of size 1 = local causal attention
    ring = RingAttention(topo, backend=backend, tag=tag, window=window, balanced=layout.cp_layout == "balanced",
                         balance_window=layout.balance_window)
    if topo.ulysses == 1:
        return ring
    return UlyssesAttention(topo, ring, layout.heads, layout.kv_heads, layout.kv_replication, tag=tag)
