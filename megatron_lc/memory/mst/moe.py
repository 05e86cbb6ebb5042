"""MsT's mini-sequences over the MoE block (Mini-Sequence Transformer, section 3, applied to the experts): the routed
part runs over chunks of ``memory.mst_mlp_chunk_size`` tokens (default: hidden size), router, dispatch, experts and
combine per chunk, each chunk under non-reentrant ``torch.utils.checkpoint`` (its input kept, the rest re-made in
backward), so the k copies of the tokens, the rows sent to the experts and the experts' ``[rows, 2f]``
intermediates exist one chunk at a time, in forward and backward. The shared expert is the spec's MLP (MsT's).

Example, Qwen3-30B-A3B (h 2048, top-8, expert width 768) with 262144 tokens a rank: unchunked, 2M copies, their
``[2M, 1536]`` expert intermediates (6 GiB in bf16) at once; in chunks of 2048 tokens, ``[16384, 1536]`` (48 MiB).
Under expert parallelism every rank runs the same number of chunks (the ranks' token counts are equal), so each
chunk's all-to-alls meet; a chunk re-made in backward exchanges again. The routers' counts are recorded by the
forward only (``model/moe_loss.py``)."""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...config import ModelConfig
from ...model.moe import MoE
from .rules import mlp_chunk_tokens


class MiniSequenceMoE(MoE):
    """``MoE`` whose routed part runs in mini-sequences (see module doc); same parameters."""

    def __init__(self, cfg: ModelConfig, parts, output_std: float):
        super().__init__(cfg, parts, output_std)
        self.chunk_tokens = mlp_chunk_tokens(parts.cfg)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.chunk_tokens:  # one chunk would only add the backward's re-run
            return super().routed(x)
        whole = super().routed
        return torch.cat([checkpoint(whole, chunk, use_reentrant=False) for chunk in x.split(self.chunk_tokens)])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, chunk_tokens={self.chunk_tokens}"
