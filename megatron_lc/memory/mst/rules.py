"""MsT's chunk rules (Mini-Sequence Transformer, section 3.4), used by the modules and by the estimator.

With N = tokens on this rank (``s_local * b``):

    MLP:  C = memory.mst_mlp_chunk_size, default hidden_size tokens -> ceil(N / C) chunks;
          N <= C -> one chunk (no slowdown for short sequences).
    head: M = memory.mst_head_chunks, default ceil(V / hidden_size) -> chunks of ceil(N / M) tokens, but
          with the default never shorter than ``MIN_HEAD_CHUNK`` tokens (so N <= 256 is not split);
          an explicit M is honoured exactly.
    The last chunk takes the remainder: N = 4100, C = 1024 -> 1024, 1024, 1024, 1024, 4. No token is dropped.
"""
from __future__ import annotations

import math

# Floor of the *default* head chunk, in tokens (an explicit M overrides it). Measured on this project's CPU (tiny
# Llama head, N = 4096, fwd+bwd, 1 thread): 33-token chunks (M = V/d) cost 1.6x the unchunked head, 128-256-token
# chunks 1.05-1.1x; the logits chunk [256, V] is then the size of the output weight itself.
MIN_HEAD_CHUNK = 256


def mlp_chunk_tokens(cfg) -> int:
    """MLP mini-sequence length in tokens: ``memory.mst_mlp_chunk_size`` or the hidden size (§3.4: C = d)."""
    return int(cfg.memory.mst_mlp_chunk_size or cfg.model.hidden_size)


def head_chunk_count(cfg) -> int:
    """Number of head mini-sequences: ``memory.mst_head_chunks`` or ceil(V / h) (§3.4: M = V/d)."""
    return int(cfg.memory.mst_head_chunks or math.ceil(cfg.model.padded_vocab_size / cfg.model.hidden_size))


def head_chunk_tokens(n_tokens: int, chunks: int, explicit: bool) -> int:
    """Rows per head chunk for ``n_tokens`` rows split into ``chunks`` mini-sequences (see module doc)."""
    size = math.ceil(n_tokens / chunks) if n_tokens else 1
    return size if explicit else max(size, min(n_tokens, MIN_HEAD_CHUNK))
