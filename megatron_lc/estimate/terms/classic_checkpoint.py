"""What-ifs for the papers' baselines (``recompute_style="checkpoint"``; the framework does not run them): classic
activation checkpointing keeps only each layer's input and re-runs the whole layer, attention included, in its
backward. It stands in for token-wise recompute (the input kept on the device) and for Memo (the input offloaded,
DeepSpeed's "checkpoint with CPU offload", Memo's alpha = 0); such a layer re-runs all its rows at once.

Example, FPDT's Table 1 setup ("AC + OC"): ``estimate(cfg, hw, 8, states="zero3", recompute_style="checkpoint")``
with ``activation_offload: memo``: the layer inputs of n - 2 layers on the host, two input buffers on the device.
"""
from __future__ import annotations

from dataclasses import replace

from .host_checkpoints import whole_layer_seconds
from .memo_offload import MemoOffload, offloaded_bytes
from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare


class ClassicCheckpoint(Term):
    """In place of token-wise recompute: the input kept, the rest rematerialised at the layer's backward. The
    layer's inventory stays the token-wise one (``shape``), as the framework's slot would hold it."""

    reruns_whole_layer = True

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        return replace(shape, local_qkv=True)

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        kept = share.groups["input"]
        no_graph = 1.0
        return replace(share, kept=kept, recompute=share.full - kept, no_graph=no_graph,
                       pre_no_graph_tokens=no_graph * run.dims.tokens)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        return replace(share, recompute=share.recompute + whole_layer_seconds(seconds))


class ClassicCheckpointOffload(MemoOffload):
    """In place of Memo: Memo's term (its alpha LP and notes), then only the layer inputs leave: alpha = 0, two
    input buffers and the one staged, everything else rematerialised. Its transfer is counted as Memo's at
    alpha = 0 (input + attention output), its recompute as the whole layer."""

    reruns_whole_layer = True

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        memo = super().memory(run, share)
        kept = share.groups["input"]
        no_graph = 1.0
        host = share.host + (("layer inputs", max(run.dims.num_layers - 2, 0) * kept),)
        return replace(memo, alpha=0.0, rounding=2 * kept, staging=kept, host=host, recompute=share.full - kept,
                       no_graph=no_graph, rerun=None, pre_no_graph_tokens=no_graph * run.dims.tokens,
                       notes=memo.notes + ("what-if: checkpoint + CPU offload of layer inputs "
                                           "(recompute_style=checkpoint)",))

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        return replace(share, recompute=share.recompute + whole_layer_seconds(seconds),
                       offloaded=share.offloaded + offloaded_bytes(run, share))
