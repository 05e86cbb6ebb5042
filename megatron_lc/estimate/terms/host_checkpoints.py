"""Activation checkpoints on the host (``activation_offload: checkpoints``; ``memory/checkpoint_offload.py``): each
layer's forward runs without a graph, its input goes to the host while the next layer computes, and its backward
fetches it and re-runs the whole layer, attention included, with the next layer's input already prefetched.

Example, Llama3-8B at 4M tokens on 8 H100s (bf16 residual stream, Ulysses 8): one input per layer and rank on the
host, 32 layers x 512K tokens x 8 KiB = 128 GiB a rank, 1 TiB a node; nothing per layer on the device.
"""
from __future__ import annotations

from dataclasses import replace

from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare


def whole_layer_seconds(seconds: LayerSeconds) -> float:
    """A layer's forward run again, attention and its communication included."""
    return seconds.linear_fwd + seconds.attention_fwd + seconds.tp_fwd + seconds.cp_fwd


class HostCheckpoints(Term):
    """``activation_offload: checkpoints`` (see the module doc)."""

    reruns_whole_layer = True

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        """Staged: the finished layer's input on its way out. At a layer's backward its skeletal tensors come back
        with the re-run, beside the fetched input and the next layer's prefetched one (none for the first layer)."""
        dims, g = run.dims, share.groups
        no_graph = 1.0
        return replace(share, kept=0.0, staging=g["input"], recompute=share.full + g["input"], no_graph=no_graph,
                       host=share.host + (("host checkpoints", dims.num_layers * g["input"]),),
                       prefetch=g["input"] if dims.num_layers > 1 else 0.0,
                       pre_no_graph_tokens=no_graph * dims.tokens)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        """The whole forward again per layer; the input crosses PCIe each way, hidden but for the excess."""
        g = LayerShape(share.shape.mlp_chunked, False, False).groups(run.dims)
        return replace(share, recompute=share.recompute + whole_layer_seconds(seconds),
                       offloaded=share.offloaded + g["input"])
