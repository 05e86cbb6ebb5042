"""Mini-Sequence Transformer (MsT, ``papers/mst_mini_sequence_transformer.txt`` §3): the MLP and the LM head + loss
run over sequence chunks, so their big intermediates never exist whole.

Selected by ``memory.mst: true``; ``apply_mst`` swaps every ``MLP`` for a ``MiniSequenceMLP`` and the ``LMHead`` for
a ``MiniSequenceLMHead``. They subclass the originals and reuse their submodules, so parameter names, init,
checkpoints and tp sharding are unchanged (``layers.0.mlp.linear_fc1.weight`` stays where it was).

Chunk rules (§3.4), with N = tokens on this rank (``s_local * b``):

    MLP:  C = memory.mst_mlp_chunk_size, default hidden_size tokens -> ceil(N / C) chunks;
          N <= C -> one chunk (no slowdown for short sequences).
    head: M = memory.mst_head_chunks, default ceil(V / hidden_size) -> chunks of ceil(N / M) tokens, but
          with the default never shorter than ``MIN_HEAD_CHUNK`` tokens (so N <= 256 is not split);
          an explicit M is honoured exactly.
    The last chunk takes the remainder: N = 4100, C = 1024 -> 1024, 1024, 1024, 1024, 4. No token is dropped.

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

import math
from typing import Optional

import torch
from torch import nn

from ..config import Config, ConfigError
from ..model.head import LMHead
from ..model.mlp import MLP
from ..parallel.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, copy_to_tp, gather_from_sp,
                                        reduce_from_tp, reduce_scatter_to_sp, vocab_parallel_cross_entropy)
from ..parallel.topology import Topology
from .mst_functions import mini_sequence_mlp
from .mst_head import mini_sequence_cross_entropy

# Floor of the *default* head chunk, in tokens (an explicit M overrides it). Measured on this project's CPU (tiny
# Llama head, N = 4096, fwd+bwd, 1 thread): 33-token chunks (M = V/d) cost 1.6x the unchunked head, 128-256-token
# chunks 1.05-1.1x; the logits chunk [256, V] is then the size of the output weight itself.
MIN_HEAD_CHUNK = 256


def mlp_chunk_tokens(cfg: Config) -> int:
    """MLP mini-sequence length in tokens: ``memory.mst_mlp_chunk_size`` or the hidden size (§3.4: C = d)."""
    return int(cfg.memory.mst_mlp_chunk_size or cfg.model.hidden_size)


def head_chunk_count(cfg: Config) -> int:
    """Number of head mini-sequences: ``memory.mst_head_chunks`` or ceil(V / h) (§3.4: M = V/d)."""
    return int(cfg.memory.mst_head_chunks or math.ceil(cfg.model.padded_vocab_size / cfg.model.hidden_size))


def head_chunk_tokens(n_tokens: int, chunks: int, explicit: bool) -> int:
    """Rows per head chunk for ``n_tokens`` rows split into ``chunks`` mini-sequences (see module doc)."""
    size = math.ceil(n_tokens / chunks) if n_tokens else 1
    return size if explicit else max(size, min(n_tokens, MIN_HEAD_CHUNK))


class MiniSequenceMLP(MLP):
    """``MLP`` run over chunks of ``chunk_tokens`` tokens; ``[s, b, h] -> [s, b, h]`` with the same tp/SP mapping."""

    def __init__(self, mlp: MLP, chunk_tokens: int):
        nn.Module.__init__(self)
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        if not (isinstance(fc1, ColumnParallelLinear) and isinstance(fc2, RowParallelLinear)):
            raise ConfigError(f"memory.mst needs the MLP's column/row parallel linears, found "
                              f"{type(fc1).__name__}/{type(fc2).__name__}")
        self.swiglu, self.linear_fc1, self.linear_fc2 = mlp.swiglu, fc1, fc2
        self.chunk_tokens = int(chunk_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        tokens = x.shape[0] * x.shape[1] * (fc1.topo.tp if fc1.sequence_parallel else 1)
        if tokens <= self.chunk_tokens:  # short sequence: one chunk would only add the backward recompute
            return super().forward(x)
        x = gather_from_sp(x, fc1.topo) if fc1.sequence_parallel else copy_to_tp(x, fc1.topo)
        s, b, h = x.shape
        y = mini_sequence_mlp(x.reshape(s * b, h), fc1.weight, fc1.bias, fc2.weight, self.swiglu, self.chunk_tokens)
        y = y.view(s, b, -1)
        y = reduce_scatter_to_sp(y, fc2.topo) if fc2.sequence_parallel else reduce_from_tp(y, fc2.topo)
        return y + fc2.bias if fc2.bias is not None else y

    def extra_repr(self) -> str:
        return f"swiglu={self.swiglu}, chunk_tokens={self.chunk_tokens}"


class MiniSequenceLMHead(LMHead):
    """``LMHead`` whose loss path runs logits + cross entropy over chunks; ``forward(hidden [s, b, h], labels
    [s, b]) -> [s, b]`` fp32 per-token loss, labels ``-100`` ignored. ``labels=None`` still returns the full
    local logits (inference asks for them)."""

    def __init__(self, head: LMHead, chunks: int, explicit: bool, ignore_index: int = -100):
        nn.Module.__init__(self)
        self.topo, self.sequence_parallel = head.topo, head.sequence_parallel
        self.output_layer, self.tied_weight = head.output_layer, head.tied_weight
        self.chunks, self.explicit, self.ignore_index = int(chunks), explicit, ignore_index

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
        loss = mini_sequence_cross_entropy(x.reshape(n, h), self.weight, labels.reshape(n), self.topo,
                                           self.chunk_tokens(n), self.ignore_index)
        return loss.view(s, b)

    def extra_repr(self) -> str:
        return f"chunks={self.chunks}{' (explicit)' if self.explicit else ''}"


def apply_mst(model: nn.Module, cfg: Config, topo: Topology) -> nn.Module:
    """Swap every ``MLP`` and ``LMHead`` of ``model`` (in place) for its mini-sequence twin; returns the model."""
    mlp_chunk = mlp_chunk_tokens(cfg)
    head_chunks, explicit = head_chunk_count(cfg), cfg.memory.mst_head_chunks is not None
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, (MiniSequenceMLP, MiniSequenceLMHead)):
                continue
            if isinstance(child, MLP):
                setattr(parent, name, MiniSequenceMLP(child, mlp_chunk))
            elif isinstance(child, LMHead):
                setattr(parent, name, MiniSequenceLMHead(child, head_chunks, explicit))
    return model
