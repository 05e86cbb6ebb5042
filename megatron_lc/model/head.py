"""Output layer + cross entropy. ``forward(hidden [s, b, h], labels [s, b])`` -> per-token loss ``[s, b]`` (fp32).

The output layer is column parallel over the vocab; the loss is vocab-parallel, so full logits never exist on one
tp rank. With ``labels=None`` the local logits shard ``[s, b, V/tp]`` is returned."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.tensor_parallel import copy_to_tp, gather_from_sp, vocab_parallel_cross_entropy


class LMHead(nn.Module):
    def __init__(self, cfg: ModelConfig, parts, tied_embedding: Optional[nn.Module] = None):
        """``tied_embedding``: the embedding whose weight the head shares (None: an output layer of its own)."""
        super().__init__()
        self.topo, self.sequence_parallel = parts.topo, parts.sequence_parallel
        if tied_embedding is None:
            self.output_layer = parts.column_linear(cfg.hidden_size, cfg.padded_vocab_size, bias=False,
                                                    std=cfg.init_method_std)
            self.tied = None
        else:
            self.output_layer = None
            self.tied = [tied_embedding]  # a list, so the embedding is not registered twice

    @property
    def weight(self) -> torch.Tensor:
        """Looked up at each use: the module's current parameter (FSDP2 swaps in the gathered one)."""
        return self.tied[0].weight if self.tied is not None else self.output_layer.weight

    def gather_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The column-parallel input mapping (all-gather with SP, identity-with-allreduce-grad without)."""
        return gather_from_sp(hidden, self.topo) if self.sequence_parallel else copy_to_tp(hidden, self.topo)

    def forward(self, hidden: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        logits = F.linear(self.gather_input(hidden), self.weight)
        if labels is None:
            return logits
        return vocab_parallel_cross_entropy(logits, labels, self.topo)
