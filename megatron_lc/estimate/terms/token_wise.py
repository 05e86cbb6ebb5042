"""Token-wise recompute (``recompute_granularity: full``; ``memory/memo/``'s executor without offload): each layer
keeps its input, its attention output and lse in its slot; the token-wise rest (norms, QKV, out-proj, MLP) runs
without a graph in the forward and again in the layer's backward, the core attention never runs twice.

Example, Llama3-8B at 1M tokens on 8 GPUs (tp 1, bf16): 16 KiB (fp32 input) + 8 KiB (out) + 128 B (lse) per token
and layer kept instead of 190 KiB; one linear forward (+ its tp communication) per layer runs again.
"""
from __future__ import annotations

from dataclasses import replace

from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare


class TokenWiseRecompute(Term):
    """``recompute_granularity: full`` (see the module doc)."""

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        return replace(shape, local_qkv=True)  # the slot holds the local q, k, v whatever the cp flavour

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        """The re-run's own tensors are the layer backward's moments (``transient.tokenwise_backward``), unless the
        attention block cannot run its backward from (out, lse): FPDT's, around which the block mode recomputes
        the dropped rest as a whole (``recompute``)."""
        g = share.groups
        kept = g["input"] + g["attn"]
        no_graph = 1.0
        return replace(share, kept=kept, recompute=0.0 if share.attention_from_lse else share.full - kept,
                       no_graph=no_graph, rerun=no_graph, pre_no_graph_tokens=no_graph * run.dims.tokens)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        return replace(share, recompute=share.recompute + (seconds.linear_fwd + seconds.tp_fwd))
