"""FPDT (Fully Pipelined Distributed Transformer; ``parallel.cp_comm_type: fpdt``, ``attention/fpdt/``): the attention
block cuts each rank's sequence into u chunks, projects and all-to-alls them one at a time and, with
``memory.fpdt_offload``, parks every finished chunk's q, k, v, out, lse and the projection's saved inputs on the host,
fetching them back double-buffered in forward and backward.

Example, Llama3-8B at 1M tokens on 8 GPUs (Ulysses 8 inside FPDT, 64K-token chunks, bf16): per layer and rank
131072 x (4096 x 2 + (2 x 32 + 2 x 8) x 128 x 2 + 32 x 4) bytes = 3.5 GiB on the host, 112 GiB for 32 layers.
"""
from __future__ import annotations

from dataclasses import replace

from ...device import HostPool
from .. import transient as T
from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare


class FPDTBlock(Term):
    """``attention/fpdt/block.FPDTSelfAttention`` (see the module doc)."""

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        return replace(shape, attention_parked=run.cfg.memory.fpdt_offload)

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        """The block's backward is its own (not from an (out, lse) pair: token-wise recompute runs around it in
        Memo's block mode). With offload, the host holds every layer's chunks until its backward -- one layer's when
        the executor re-runs whole layers (``reruns_whole_layer``) -- plus one backward's do^ and fp32 dq chunks
        (``attention/fpdt/host_share.py``: L x F + B), each parked view rounded up to ``HostPool.ALIGN`` (~6 per
        chunk and layer, 2 for the backward); setup measures one block's forward and backward."""
        share = replace(share, attention_from_lse=False)
        if not run.cfg.memory.fpdt_offload:
            return share
        dims = run.dims
        kv, a, nq = dims.kv_heads_after_a2a, dims.compute_bytes, dims.heads_local
        layers = 1 if run.terms.executor.reruns_whole_layer else dims.num_layers
        per_layer = dims.tokens * (dims.hidden * a + (2 * nq + 2 * kv) * dims.head_dim * a + nq * 4)
        views = 6
        if run.terms.layer_rerun.block_reads_layer_input:  # norm 1's saved input rows and rstd, parked too
            per_layer += dims.tokens_residual * (dims.hidden * dims.residual_bytes + 4)
            views += 2
        parked = layers * per_layer
        parked += dims.tokens * nq * dims.head_dim * (a + 4) + (views * layers + 2) * dims.fpdt_chunks * HostPool.ALIGN
        return replace(share, host=share.host + (("FPDT chunks", parked),),
                       setup_probes=share.setup_probes + (share.full + T.layer_backward(run.cfg, dims),))

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        """With offload, the chunk traffic overlaps the layer's attention: forward, every chunk to the host and
        u(u-1)/2 kv fetches; backward, u kv and u(u+1)/2 q-set fetches; one chunk's transfer exposed (fill). Under
        a window or documents only the chunk pairs within reach are fetched (``Dims.earlier_chunks``)."""
        if not run.cfg.memory.fpdt_offload:
            return share
        dims = run.dims
        kv, a, d, nq, n = dims.kv_heads_after_a2a, dims.compute_bytes, dims.head_dim, dims.heads_local, dims.fpdt_chunks
        pcie = run.host_bytes_per_s
        kv_chunk = 2 * dims.tokens / n * kv * d * a
        q_chunk = dims.tokens / n * (3 * nq * d * a + nq * 4 + 2 * nq * d * 4)  # q, out, dout, lse, dq r/w
        save = dims.tokens * ((2 * nq + 2 * kv) * d * a + nq * 4)
        pairs = dims.earlier_chunks(n)  # n(n-1)/2 without masks
        fwd_bytes = save + pairs * kv_chunk
        bwd_bytes = n * kv_chunk + (n + pairs) * q_chunk
        return replace(share,
                       host_fwd=share.host_fwd + (max(0.0, fwd_bytes / pcie - seconds.attention_fwd) + kv_chunk / pcie),
                       host_bwd=share.host_bwd + (max(0.0, bwd_bytes / pcie - seconds.attention_bwd)
                                                  + (kv_chunk + q_chunk) / pcie))
