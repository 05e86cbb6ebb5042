"""A layer's re-run in mini-sequences (``memory.layer_chunk_size``): the executor's re-run takes ``c`` local rows
at a time outside the core attention, so what a re-run holds outside attention is O(c) rows. Two implementations,
by executor (``config.techniques.MINI_SEQUENCES_BY_EXECUTOR``): token-wise recompute and Memo cut their dropped
tokens' re-run (``memory/memo/steps.py``), the host checkpoints their layer's forward and re-run
(``memory/chunked_layer.py``). Either reads what the executor's term set: alpha, the no-graph share, the prefetch.

A chunk that holds every re-run row is no chunking (``inventory.layer_chunk_share``: None), in the framework and
here. Example, Llama3-8B at 4M tokens on 8 H100s with the host checkpoints and c = 16384 rows: each mini-sequence
is 16384 / 524288 = 1/32 of the rank's tokens; q, k, v, out, lse, the fetched and the prefetched input stay whole.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from ..inventory import attention_skeletal, group_bytes, layer_chunk_share, layer_skeletal, mst_mlp_chunk, \
    qkv_local_bytes, qkv_rerun_bytes
from .term import LayerShape, MemoryShare, Run, Term


def chunk_saved_bytes(run: Run, share_of_tokens: float) -> float:
    """What one mini-sequence's re-run saves for its backward: its share of the token-wise rest but q, k, v (held
    whole). MsT chunks the MLP inside a mini-sequence only when the mini-sequence is longer than its chunk."""
    dims = run.dims
    mlp_chunked = mst_mlp_chunk(run.cfg, dims, share_of_tokens * dims.tokens) is not None
    rerun_items = layer_skeletal(dims, mlp_chunked, False, True)
    return share_of_tokens * (group_bytes(rerun_items)["others"] - qkv_local_bytes(dims))


def rerun_share(run: Run, share: MemoryShare) -> Optional[float]:
    """One mini-sequence's share of the rank's tokens, or None when the re-run takes its rows at once."""
    return layer_chunk_share(run.cfg, run.dims, share.alpha or 0.0) if share.no_graph else None


class AtOnce(Term):
    """The re-run (if any) takes all its rows at once: the executor's term says it all."""


class TokenWiseMiniSequences(Term):
    """Token-wise recompute / Memo in mini-sequences: the dropped tokens' post re-run a chunk at a time, their q, k, v
    recomputed whole without a graph for the attention backward after it (``attn_saved``); nothing else is
    rematerialised beside the layer backward's moments."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        part = rerun_share(run, share)
        if part is None:
            return share
        return replace(share, chunk_tokens=part * run.dims.tokens, chunk_saved=chunk_saved_bytes(run, part),
                       recompute=0.0, attn_saved=share.no_graph * qkv_rerun_bytes(run.dims))


class LayerMiniSequences(Term):
    """The host checkpoints in mini-sequences (``chunked_layer.ChunkedLayer``): the forward and the re-run take
    ``pre`` / ``post`` a chunk at a time around one whole attention, through the core attention's (out, lse) pair;
    the fetched input, q, k, v (assembled chunk by chunk), out and lse stay whole, and the next layer's input is
    prefetched once the attention backward is done."""

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        chunked = layer_chunk_share(run.cfg, run.dims) is not None
        return replace(shape, local_qkv=shape.local_qkv or chunked)  # q, k, v assembled whole like the token-wise slot

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        part = rerun_share(run, share)
        if part is None:
            return share
        dims, g = run.dims, share.groups
        return replace(share, chunk_tokens=part * dims.tokens, chunk_saved=chunk_saved_bytes(run, part),
                       recompute=g["input"] + qkv_local_bytes(dims) + g["attn"], pre_no_graph_tokens=part * dims.tokens,
                       rerun=share.no_graph, prefetch_after_attention=share.prefetch)


def post_saved_bytes(run: Run, share_of_tokens: float) -> float:
    """What one mini-sequence's ``post`` saves for its backward around FPDT's block (whose output rows it reads as
    they are): the residual after attention and norm 2's rstd (residual rows), norm 2's output as fc1's input and,
    unless MsT chunks them, the MLP's intermediates."""
    dims, a = run.dims, run.dims.compute_bytes
    mlp = 0.0 if mst_mlp_chunk(run.cfg, dims, share_of_tokens * dims.tokens) is not None else \
        dims.tokens * (4 if dims.swiglu else 2) * dims.ffn_local * a
    return share_of_tokens * (dims.tokens_residual * (dims.hidden * dims.residual_bytes + 4)
                              + dims.tokens * dims.hidden * a + mlp)


class BlockMiniSequences(Term):
    """The host checkpoints in mini-sequences around FPDT's block (``chunked_layer.BlockAttentionPart``): the block
    reads the layer input, norm 1 inside its chunk projections, and parks its chunks on the host (with
    ``fpdt_offload``; without, they stay on the device through the re-run); post runs a mini-sequence at a time
    within each of the block's chunks beside the block's whole output; the next input is prefetched after the
    block's backward."""

    block_reads_layer_input = True

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        part = layer_chunk_share(run.cfg, run.dims)
        dims, g = run.dims, share.groups
        on_device = 0.0 if run.cfg.memory.fpdt_offload else sum(
            i.bytes for i in attention_skeletal(dims, False) if not i.name.startswith("linear_proj input"))
        return replace(share, chunk_tokens=part * dims.tokens, chunk_saved=post_saved_bytes(run, part),
                       recompute=g["input"] + on_device, pre_no_graph_tokens=0.0, rerun=share.no_graph,
                       prefetch_after_attention=share.prefetch)
