"""The MsT modules (Mini-Sequence Transformer, section 3): the MLP and the LM head + loss run over sequence chunks,
so their big intermediates never exist whole.

Selected by ``memory.mst: true``: the model spec constructs a ``MiniSequenceMLP`` in every layer and a
``MiniSequenceLMHead`` instead of the plain ``MLP`` / ``LMHead``. They subclass the originals (same constructor, same
submodules), so parameter names, init, checkpoints and tp sharding are those of the plain model
(``layers.0.mlp.linear_fc1.weight`` is where it always is). Chunk rules: ``rules.py``.

Example, tiny Llama (h = 256, V = 32000, FFN 896) at N = 16384: MLP 64 chunks of 256 tokens, so the SwiGLU
intermediates are ``[256, 1792]`` instead of ``[16384, 1792]``; head M = 125 -> ceil(16384/125) = 132 tokens,
raised to the 256-token floor -> 64 chunks, so the logits are ``[256, 32000]`` (33 MB fp32) instead of
``[16384, 32000]`` (2.1 GB). Llama3-8B (h = 4096, V = 128256) at N = 131072: MLP 32 chunks of 4096; head
M = 32 chunks of 4096 tokens.

Parallel layouts: the tp/SP mappings are those of the unchunked linears, applied to whole tensors around the
chunked core. tp=2 with Megatron SP, s=8: rank 0 holds tokens 0-3 and rank 1 tokens 4-7 of the hidden states; the
MLP all-gathers all 8 tokens, each rank runs its ``ffn/2`` slice of the MLP over chunks of the 8 tokens, and the
reduce-scatter hands tokens 0-3 back to rank 0. The head all-gathers too; each rank's logits chunk is
``[n, V/2]``, the softmax max and sum are reduced over the two vocab shards per chunk. Context parallelism (ring,
Ulysses, FPDT) and recompute/offload change nothing here: both blocks are token-wise, any subset and any order of
tokens is chunked the same way.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ...config import ModelConfig
from ...model.head import LMHead
from ...model.mlp import MLP
from ...parallel.tensor_parallel import (copy_to_tp, gather_from_sp, reduce_from_tp, reduce_scatter_to_sp,
                                         vocab_parallel_cross_entropy)
from .head_function import mini_sequence_cross_entropy
from .mlp_function import mini_sequence_mlp
from .rules import head_chunk_count, head_chunk_tokens, mlp_chunk_tokens

class MiniSequenceMLP(MLP):
    """``MLP`` run over chunks of ``chunk_tokens`` tokens; ``[s, b, h] -> [s, b, h]`` with the same tp/SP mapping."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__(cfg, parts, output_std)
        self.chunk_tokens = mlp_chunk_tokens(parts.cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        tokens = x.shape[0] * x.shape[1] * (fc1.topo.tp if fc1.sequence_parallel else 1)
        if tokens <= self.chunk_tokens:  # short sequence: one chunk would only add the backward recompute
            return super().forward(x)
        x = gather_from_sp(x, fc1.topo) if fc1.sequence_parallel else copy_to_tp(x, fc1.topo)
        s, b, h = x.shape
        y = mini_sequence_mlp(x.reshape(s * b, h), fc1.weight, fc1.bias, fc2.weight, self.kind, self.chunk_tokens)
        y = y.view(s, b, -1)
        y = reduce_scatter_to_sp(y, fc2.topo) if fc2.sequence_parallel else reduce_from_tp(y, fc2.topo)
        return y + fc2.bias if fc2.bias is not None else y

    def extra_repr(self) -> str:
        return f"activation={self.kind}, chunk_tokens={self.chunk_tokens}"


class MiniSequenceLMHead(LMHead):
    """``LMHead`` whose loss path runs logits + cross entropy over chunks; ``forward(hidden [s, b, h], labels
    [s, b]) -> [s, b]`` fp32 per-token loss, labels ``-100`` ignored. ``labels=None`` still returns the full
    local logits (inference asks for them)."""

    def __init__(self, cfg: ModelConfig, parts, tied_embedding: Optional[nn.Module] = None, ignore_index: int = -100):
        super().__init__(cfg, parts, tied_embedding)
        self.chunks = head_chunk_count(parts.cfg)
        self.explicit = parts.cfg.memory.mst_head_chunks is not None
        self.ignore_index = ignore_index

    def chunk_tokens(self, n_tokens: int) -> int:
        return head_chunk_tokens(n_tokens, self.chunks, self.explicit)

    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden, None)
        x = self.gather_input(hidden)
        s, b, h = x.shape
        if labels.shape != (s, b):
            raise ValueError(f"labels {tuple(labels.shape)} do not match the head input's tokens {(s, b)}")
        n = s * b
        if self.chunk_tokens(n) >= n and not self.explicit:  # short sequence: the unchunked path
            return vocab_parallel_cross_entropy(nn.functional.linear(x, self.weight), labels, self.topo,
                                                self.ignore_index)
        return mini_sequence_cross_entropy(x.reshape(n, h), self.weight, labels, self.topo, self.chunk_tokens(n),
                                           self.ignore_index)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}{' (explicit)' if self.explicit else ''}"
