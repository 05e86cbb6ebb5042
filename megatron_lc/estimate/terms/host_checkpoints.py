"""Activation checkpoints on the host (``activation_offload: checkpoints``; ``memory/checkpoint_offload.py``): each
layer's forward runs without a graph, the input of every k-th layer (``memory.checkpoint_every``) goes to the host
while the next layers compute, and each layer's backward re-runs the whole layer, attention included, from its input
-- fetched (a segment's first layer, the next one prefetched) or re-made on the device by its segment's top layer,
which runs the layers below it again without a graph.

Example, Llama3-8B at 4M tokens on 8 H100s (bf16 residual stream, Ulysses 8): one input per layer and rank on the
host, 32 layers x 512K tokens x 8 KiB = 128 GiB a rank, 1 TiB a node; nothing per layer on the device. With k = 2:
16 inputs, 64 GiB a rank, for 16 more layer forwards a step (a tenth more compute: a layer's forward is ~1/4 of its
forward + backward + re-run).
"""
from __future__ import annotations

from dataclasses import replace

from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare


def whole_layer_seconds(seconds: LayerSeconds) -> float:
    """A layer's forward run again, attention and its communication included."""
    return seconds.linear_fwd + seconds.attention_fwd + seconds.tp_fwd + seconds.cp_fwd


def segments(run: Run) -> tuple[int, int]:
    """(k, checkpoints): the segment length (at most the layer count) and ceil(L / k), the inputs on the host."""
    layers = run.dims.num_layers
    k = min(run.cfg.memory.checkpoint_every, layers)
    return k, -(-layers // k)


class HostCheckpoints(Term):
    """``activation_offload: checkpoints`` (see the module doc)."""

    reruns_whole_layer = True

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        """Staged: the finished layer's input on its way out. At a layer's backward its skeletal tensors come back
        with the re-run, beside the fetched input and the next layer's prefetched one (none for the first layer); a
        segment's top layer holds the k - 2 re-made inputs between it and its checkpoint instead (k >= 3)."""
        dims, g = run.dims, share.groups
        k, checkpoints = segments(run)
        no_graph = 1.0
        return replace(share, kept=0.0, staging=g["input"], recompute=share.full + g["input"], no_graph=no_graph,
                       host=share.host + (("host checkpoints", checkpoints * g["input"]),),
                       prefetch=g["input"] if dims.num_layers > 1 else 0.0, remade=max(0, k - 2) * g["input"],
                       pre_no_graph_tokens=no_graph * dims.tokens)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        """The whole forward again per layer, plus the re-making: L - ceil(L / k) layer forwards a step; the inputs
        cross PCIe (a checkpoint out once, back twice when k > 1), hidden but for the excess. Under FSDP2 each
        re-made layer's weights are gathered once more (not counted: ~1 ms a layer, a step of this length is
        hours)."""
        g = LayerShape(share.shape.mlp_chunked, False, False).groups(run.dims)
        k, checkpoints = segments(run)
        layers = run.dims.num_layers
        remake = (layers - checkpoints) / layers
        crossings = min(1.0, checkpoints * (2 if k > 1 else 1) / layers)
        return replace(share, recompute=share.recompute + (1 + remake) * whole_layer_seconds(seconds),
                       offloaded=share.offloaded + crossings * g["input"])
