"""MsT (the Mini-Sequence Transformer): the MLP and the LM head run over token chunks (``memory/mst/``), so their
large intermediates exist one chunk at a time; the chunk rules are MsT's own (``memory/mst/rules.py``, read through
``inventory.mst_mlp_chunk`` / ``mst_head_chunk``: no chunking when the rank's tokens fit one chunk).

Example, Llama3-8B at 1M tokens on 8 GPUs (h 4096, ffn 14336, 32 / 8 heads): the MLP keeps only its input, its
forward runs again chunk by chunk in its backward -- 3f / (3f + (nq + 2 nkv) d + nq d) = 81% of a layer's linear
forward FLOPs, charged at the cost MsT measured for it (``MLP_RERUN_COST``: 0.26 of those seconds); the head keeps
its input and one fp32 lse per token instead of the softmax.
"""
from __future__ import annotations

from dataclasses import replace

from ..inventory import final_skeletal, mst_head_chunk, mst_mlp_chunk
from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare

# What the chunked MLP's re-run costs, as a share of the MLP's forward: MsT's own measurement (its Table 6, the step
# with MsT less the step with recomputation alone at the same batch: Llama3-8B +0.12 s -> 0.15, Llama2-7B +0.48 s ->
# 0.38; bench/estimate_papers.py --time --fit), not the whole forward again (1.0, +15% on those steps).
MLP_RERUN_COST = 0.26


class MiniSequenceMlpAndHead(Term):
    """``MiniSequenceMLP`` and ``MiniSequenceLMHead`` (``memory.mst: true``)."""

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        return replace(shape, mlp_chunked=mst_mlp_chunk(run.cfg, run.dims) is not None)

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        dims = run.dims
        head_chunked = mst_head_chunk(run.cfg, dims) is not None
        return replace(share, head_kept=sum(i.bytes for i in final_skeletal(dims, head_chunked)),
                       head_softmax=0.0 if head_chunked else dims.tokens * dims.vocab_local * 4.0)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        """Each MLP chunk's forward runs again in its backward; the head computes its gradient in its forward
        (``memory/mst/head_function.py``): nothing of it runs again."""
        if not share.shape.mlp_chunked:
            return share
        dims = run.dims
        nq, nkv, d, f = dims.heads_local, dims.kv_heads_local, dims.head_dim, dims.ffn_local
        mlp_share = (3 if dims.swiglu else 2) * f / ((nq + 2 * nkv) * d + nq * d + (3 if dims.swiglu else 2) * f)
        return replace(share, recompute=share.recompute + MLP_RERUN_COST * mlp_share * seconds.linear_fwd)
