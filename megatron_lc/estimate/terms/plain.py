"""The plain techniques: a layer run under autograd, the model's own attention block, the plain MLP and LM head.

Example, Llama3-8B at 1M tokens on 8 GPUs (tp 1, ring cp 8, bf16): every layer keeps its whole skeletal set, 23.8 x
(2h) bytes per token (docs/estimator.md, "Kept (skeletal) tensors of one layer"), and the head keeps the fp32
softmax ``[s/cp, V]`` of the vocab-parallel cross entropy (62.6 GiB at 128K tokens a rank).
"""
from __future__ import annotations

from dataclasses import replace

from ..inventory import final_skeletal
from .term import MemoryShare, Run, Term


class PlainLayer(Term):
    """No executor (``memory.recompute_granularity: none``, no offload): every layer keeps all its skeletal
    tensors on the device until its backward, nothing runs twice."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        return replace(share, kept=share.full)


class SelfAttentionBlock(Term):
    """``model/attention.SelfAttention``: QKV, the core attention, out-proj; its backward runs from the core's
    (out, lse) pair, so token-wise recompute never runs attention again."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        return replace(share, attention_from_lse=True)


class PlainMlpAndHead(Term):
    """``model/mlp.MLP`` and ``model/head.LMHead``: the MLP keeps its intermediates (the layer's shape as is), the
    head its input and the fp32 softmax of the vocab-parallel cross entropy."""

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        dims = run.dims
        return replace(share, head_kept=sum(i.bytes for i in final_skeletal(dims, False)),
                       head_softmax=dims.tokens * dims.vocab_local * 4.0)
