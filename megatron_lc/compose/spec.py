"""The model spec: which class builds each part, as data.

``model_spec(cfg, layout, ctx)`` returns a ``ModelSpec`` naming the class that builds each attention block, MLP and
head, and the executor each layer runs with; the model (``model/``) constructs whatever the spec names and never
knows which technique it got. Nothing is swapped in or patched after construction. Example, ``memory.mst: true``,
``recompute_granularity: full``, ``cp_comm_type: fpdt``::

    ModelSpec(attention_block=FPDTSelfAttention, mlp=MiniSequenceMLP, head=MiniSequenceLMHead,
              executor=partial(MemoBlockExecutor, runtime, 1))

``ModelParts`` is what ``model/`` asks for while it is constructed: the layout's linears, embedding and core
attention (the tp/SP mapping, the context-parallel attention and the kernels of the execution's device are chosen
here, not in the model code), the spec and the model's context.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

from torch import nn

from ..attention import build_core_attention
from ..attention.backends import Kernels
from ..attention.fpdt.block import FPDTSelfAttention
from ..config import Config, Execution, Layout
from ..memory.checkpoint_offload import CheckpointOffloadExecutor
from ..memory.memo import MemoBlockExecutor, MemoExecutor
from ..memory.mst import MiniSequenceLMHead, MiniSequenceMLP
from ..memory.recompute import SelectiveExecutor
from ..model.attention import SelfAttention
from ..model.head import LMHead
from ..model.mlp import MLP
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel.topology import Topology
from .context import ModelContext


@dataclass(frozen=True)
class ModelSpec:
    """Which class builds each part (constructor signatures those of the plain classes) and the layers' executor
    factory (``None``: plain autograd)."""

    attention_block: type = SelfAttention  # (cfg, parts, layer_number, output_std)
    mlp: type = MLP  # (cfg, parts, output_std)
    head: type = LMHead  # (cfg, parts, tied_embedding)
    executor: Optional[Callable[[], object]] = None  # () -> fn(layer, x, rope) -> y


def model_spec(cfg: Config, layout: Layout, ctx: ModelContext) -> ModelSpec:
    """The spec of ``cfg`` (combinations were refused by ``resolve_layout`` before this point)."""
    fpdt = layout.cp_comm_type == "fpdt"
    executor = None
    if ctx.memo is not None:  # token-wise recompute (full) or Memo; around FPDT's block in block mode
        executor = partial(MemoBlockExecutor if fpdt else MemoExecutor, ctx.memo, layout.sp_degree)
    elif ctx.checkpoints is not None:
        executor = partial(CheckpointOffloadExecutor, ctx.checkpoints)
    elif cfg.memory.recompute_granularity == "selective":
        executor = SelectiveExecutor
    return ModelSpec(attention_block=FPDTSelfAttention if fpdt else SelfAttention,
                     mlp=MiniSequenceMLP if cfg.memory.mst else MLP,
                     head=MiniSequenceLMHead if cfg.memory.mst else LMHead,
                     executor=executor)


@dataclass
class ModelParts:
    """What ``model/`` asks for while it is constructed (see module doc)."""

    cfg: Config
    layout: Layout
    topo: Topology
    spec: ModelSpec = field(default_factory=ModelSpec)
    ctx: ModelContext = field(default_factory=ModelContext)
    execution: Optional[Execution] = None  # the run's; None: attention kernels chosen by the tensors' device

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    def column_linear(self, in_f: int, out_f: int, *, bias: bool, std: float, stride: int = 1) -> nn.Module:
        return ColumnParallelLinear(in_f, out_f, self.topo, bias=bias, sequence_parallel=self.sequence_parallel,
                                    stride=stride, init_std=std)

    def row_linear(self, in_f: int, out_f: int, *, bias: bool, std: float) -> nn.Module:
        return RowParallelLinear(in_f, out_f, self.topo, bias=bias, sequence_parallel=self.sequence_parallel,
                                 init_std=std)

    def vocab_embedding(self, vocab: int, hidden: int, *, std: float) -> nn.Module:
        return VocabParallelEmbedding(vocab, hidden, self.topo, sequence_parallel=self.sequence_parallel,
                                      init_std=std)

    def kernels(self) -> Kernels:
        """The attention kernels of ``parallel.attention_backend`` for the execution's kernel device."""
        return Kernels(self.cfg.parallel.attention_backend,
                       self.execution.kernel_device if self.execution is not None else None)

    def core_attention(self, layer_number: int) -> nn.Module:
        return build_core_attention(self.layout, self.topo, self.kernels(), layer_number)
