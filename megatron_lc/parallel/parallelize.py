"""The model spec and a side-effect-free ``build_model``.

Choosing a module is data: ``model_spec(cfg, layout)`` returns a ``ModelSpec`` naming the class that builds each
attention block, MLP and head, and the executor each layer runs with; the model (``model/``) constructs whatever
the spec names and never knows which technique it got. Nothing is swapped in or patched after construction.
Example, ``memory.mst: true``, ``recompute_granularity: full``, ``cp_comm_type: fpdt``::

    ModelSpec(attention_block=FPDTSelfAttention, mlp=MiniSequenceMLP, head=MiniSequenceLMHead,
              executor=partial(MemoBlockExecutor, runtime, 1))

``ModelParts`` is what ``model/`` asks for the layout's linears, embedding and core attention (the tp/SP mapping and
the context-parallel attention are chosen here, not in the model code), plus the spec and the model's context.

``build_model`` is pure: it constructs and initialises the model on the host and returns it with its
``ModelContext`` -- the run-time state of the memory techniques (the framework-buffer arena, Memo's runtime, the
FPDT blocks' accounts), kept beside the model, never attached to it. Moving to the device, Memo's calibration and
the memory plan are later, explicit steps of ``training/setup.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

from ..attention import build_core_attention
from ..attention.fpdt.block import FPDTSelfAttention
from ..attention.fpdt.buffers import FPDTState
from ..config import Config, Layout
from ..device import HostPool
from ..memory.arena import ArenaHandle
from ..memory.checkpoint_offload import CheckpointOffload, CheckpointOffloadExecutor
from ..memory.memo import MemoBlockExecutor, MemoExecutor, MemoRuntime
from ..memory.mst import MiniSequenceLMHead, MiniSequenceMLP
from ..memory.recompute import SelectiveExecutor
from ..model.attention import SelfAttention
from ..model.head import LMHead
from ..model.init import init_model
from ..model.mlp import MLP
from ..model.transformer import GPTModel
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from .topology import Topology


@dataclass
class ModelContext:
    """Run-time state of a built model's memory techniques, returned beside the model by ``build_model``."""

    arena: ArenaHandle = field(default_factory=ArenaHandle)  # where framework buffers come from (memory plan)
    memo: Optional[MemoRuntime] = None  # recompute_granularity full / Memo offload: buffers, host copies, counters
    fpdt: Optional[FPDTState] = None  # FPDT blocks: device / host accounts, per-device buffers and streams
    checkpoints: Optional[CheckpointOffload] = None  # activation_offload checkpoints: layer inputs on the host
    host_pool: HostPool = field(default_factory=HostPool)  # Memo's and FPDT's host memory: one allocation


@dataclass(frozen=True)
class ModelSpec:
    """Which class builds each part (constructor signatures those of the plain classes) and the layers' executor
    factory (``None``: plain autograd)."""

    attention_block: type = SelfAttention  # (cfg, parts, layer_number, output_std)
    mlp: type = MLP  # (cfg, parts, output_std)
    head: type = LMHead  # (cfg, parts, tied_embedding)
    executor: Optional[Callable[[], object]] = None  # () -> fn(layer, x, rope) -> y


def model_context(cfg: Config, layout: Layout) -> ModelContext:
    """The context the spec's modules will share: Memo's runtime for recompute full / Memo, FPDT's state for fpdt."""
    m = cfg.memory
    ctx = ModelContext()
    offload = m.activation_offload == "memo"
    if offload or m.recompute_granularity == "full":
        ctx.memo = MemoRuntime(cfg.model.num_layers, offload=offload, pool=ctx.host_pool,
                               chunk_tokens=m.layer_chunk_size)
    if layout.cp_comm_type == "fpdt":
        ctx.fpdt = FPDTState(ctx.arena, ctx.host_pool)
    if m.activation_offload == "checkpoints":  # the residual stream between layers, [s, b, h] per rank
        ctx.checkpoints = CheckpointOffload(cfg.model.num_layers, ctx.host_pool, m.layer_chunk_size,
                                            layout.sp_degree)
        # bf16 when the step autocasts (training/setup.py: train.bf16 on CUDA) and the residual follows it
        autocast = cfg.train.bf16 and cfg.train.device != "cpu" and torch.cuda.is_available()
        bf16 = autocast and not cfg.model.fp32_residual_connection
        ctx.checkpoints.reserve((layout.block_seq_length, layout.micro_batch_size, cfg.model.hidden_size),
                                torch.bfloat16 if bf16 else torch.float32)
    return ctx


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

    def core_attention(self, layer_number: int) -> nn.Module:
        return build_core_attention(self.layout, self.topo, self.cfg.parallel.attention_backend, layer_number)


def build_model(cfg: Config, layout: Layout, topo: Topology,
                adjust_spec: Optional[Callable[[ModelSpec], ModelSpec]] = None) -> tuple[GPTModel, ModelContext]:
    """The model for this rank, initialised layout-independently from ``cfg.train.seed`` (on the host), and its
    context. ``adjust_spec``: changes the config's spec before construction (a comparison row or a test double,
    e.g. ``lambda s: dataclasses.replace(s, executor=LayerCheckpointExecutor)``)."""
    ctx = model_context(cfg, layout)
    spec = model_spec(cfg, layout, ctx)
    if adjust_spec is not None:
        spec = adjust_spec(spec)
    model = GPTModel(cfg.model, ModelParts(cfg, layout, topo, spec, ctx))
    init_model(model, cfg.train.seed, topo)
    return model, ctx
