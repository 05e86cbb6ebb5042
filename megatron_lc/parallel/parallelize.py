"""Choose the model's parts for a layout and build the model.

``ModelParts`` is what ``model/`` asks for its linears, embedding and core attention; the choice of tp/SP mapping
and of the context-parallel attention happens here, not in the model code."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .topology import Topology


@dataclass
class ModelParts:
    cfg: Config
    topo: Topology

    @property
    def sequence_parallel(self) -> bool:
        return self.cfg.parallel.sequence_parallel and self.topo.tp > 1

    def column_linear(self, in_f: int, out_f: int, *, bias: bool, std: float, stride: int = 1) -> nn.Module:
        return ColumnParallelLinear(in_f, out_f, self.topo, bias=bias, sequence_parallel=self.sequence_parallel,
                                    stride=stride, init_std=std)

    def row_linear(self, in_f: int, out_f: int, *, bias: bool, std: float) -> nn.Module:
        return RowParallelLinear(in_f, out_f, self.topo, bias=bias, sequence_parallel=self.sequence_parallel,
                                 init_std=std)

    def vocab_embedding(self, vocab: int, hidden: int, *, std: float) -> nn.Module:
        return VocabParallelEmbedding(vocab, hidden, self.topo, sequence_parallel=self.sequence_parallel,
                                      init_std=std)

    def core_attention(self, layer_number: int) -> nn.Module:
        if self.cfg.parallel.cp_comm_type == "fpdt":  # FPDT (issue 4): the whole block is replaced in build_model
            from ..attention.fpdt import FPDTCoreAttentionPlaceholder

            return FPDTCoreAttentionPlaceholder()
        from ..attention import build_core_attention

        return build_core_attention(self.cfg, self.topo, layer_number)


def build_model(cfg: Config, topo: Topology, device: torch.device) -> nn.Module:
    """The model for this rank, initialised layout-independently from ``cfg.train.seed``, on ``device``."""
    from ..memory import apply_memory_features
    from ..model.init import init_model
    from ..model.transformer import GPTModel

    model = GPTModel(cfg.model, ModelParts(cfg, topo))
    init_model(model, cfg.train.seed, topo)
    if cfg.parallel.cp_comm_type == "fpdt":  # FPDT (issue 4): chunked attention blocks, same parameters
        from ..attention.fpdt import apply_fpdt

        apply_fpdt(model, cfg, topo)
    model = apply_memory_features(model, cfg, topo)
    return model.to(device)
