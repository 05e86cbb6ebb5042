"""Parallelism below the model: ``topology.py`` (the rank grid dp x cp x tp, cp = ring x ulysses, and its
groups), ``collectives.py`` + ``comm_stats.py`` (collectives with byte counters), ``tensor_parallel.py`` (column /
row linears, vocab-parallel embedding and cross entropy, Megatron SP mappings), ``token_layout.py`` (zigzag,
contiguous and FPDT's strided token layouts; ``shard_batch``), ``fsdp.py`` (FSDP2 over dp x cp)."""
from .topology import Axis, Topology

__all__ = ["Axis", "Topology"]
