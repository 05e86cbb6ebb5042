"""The model spec: which class builds each part, as data.

``model_spec(cfg, layout, ctx)`` returns a ``ModelSpec`` naming the class that builds each attention block, MLP and
head, and the executor each layer runs with; the model (``model/``) constructs whatever the spec names and never
knows which technique it got. Nothing is swapped in or patched after construction. Each slot's class is looked up
by the slot's technique (``config.Techniques``, the key the estimator's terms are looked up by too) in this
module's dicts. Example, ``memory.mst: true``, ``recompute_granularity: full``, ``cp_comm_type: fpdt``::

    ModelSpec(attention_block=FPDTSelfAttention, mlp=MiniSequenceMLP, head=MiniSequenceLMHead,
              executor=partial(MemoBlockExecutor, runtime, 1))

``ModelParts`` is what ``model/`` asks for while it is constructed: the layout's linears, embedding and core
attention (the tp/SP mapping, the context-parallel attention and the kernels of the execution's device are chosen
here, not in the model code), the spec and the model's context.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional

from torch import nn

from ..attention import build_core_attention
from ..attention.backends import Kernels
from ..attention.fpdt.block import FPDTSelfAttention
from ..config import Config, Execution, Layout, resolve_techniques
from ..memory.checkpoint_offload import CheckpointOffloadExecutor
from ..memory.memo import MemoBlockExecutor, MemoExecutor
from ..memory.mst import MiniSequenceLMHead, MiniSequenceMLP, MiniSequenceMoE
from ..memory.recompute import SelectiveExecutor
from ..model.attention import SelfAttention
from ..model.head import LMHead
from ..model.mlp import MLP
from ..model.moe import MoE
from ..model.norm import build_norm, norm_kind
from ..parallel.expert_parallel import ExpertDispatcher
from ..parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..parallel.topology import Topology
from .context import ModelContext


def no_norm(hidden: int, eps: float, grads_partial_over_tp: bool) -> nn.Module:
    """Where the architecture has no norm (a post norm off): ``nn.Identity``, which returns its input itself."""
    return nn.Identity()


@dataclass(frozen=True)
class ModelSpec:
    """Which class builds each part (constructor signatures those of the plain classes), the layers' executor
    factory (``None``: plain autograd) and the norms the architecture has (``model/norm.build_norm``'s signature
    ``(hidden, eps, grads_partial_over_tp)``; ``qk_norm`` None: no q/k norm)."""

    attention_block: type = SelfAttention  # (cfg, parts, layer_number, output_std)
    mlp: type = MLP  # (cfg, parts, output_std)
    head: type = LMHead  # (cfg, parts, tied_embedding)
    executor: Optional[Callable[[], object]] = None  # () -> fn(layer, x, rope) -> y
    norm: Callable[..., nn.Module] = partial(build_norm, "RMSNorm")  # every hidden-size norm
    qk_norm: Optional[Callable[..., nn.Module]] = None  # per head, over kv_channels (model.qk_layernorm)
    post_self_attn_norm: Callable[..., nn.Module] = no_norm  # model.post_self_attn_layernorm
    post_mlp_norm: Callable[..., nn.Module] = no_norm  # model.post_mlp_layernorm
    moe: type = MoE  # the MLP of the MoE layers, (cfg, parts, output_std) like ``mlp``
    moe_layers: tuple = ()  # which layers take ``moe`` (model.moe_layer_freq; empty: none)

    def mlp_of(self, layer_number: int) -> type:
        """The class of layer ``layer_number``'s MLP: ``moe`` on the MoE layers, else ``mlp``."""
        return self.moe if self.moe_layers and self.moe_layers[layer_number] else self.mlp


# The class each slot's technique builds, looked up by ``config.Techniques`` (adding a technique: one entry here)
ATTENTION_BLOCKS = {"self_attention": SelfAttention, "fpdt": FPDTSelfAttention}
MLPS = {"plain": MLP, "mst": MiniSequenceMLP}
MOES = {"plain": MoE, "mst": MiniSequenceMoE}
HEADS = {"plain": LMHead, "mst": MiniSequenceLMHead}
# token-wise recompute and Memo run around the attention block: whole layers, or Memo's block mode around FPDT's
TOKEN_WISE_EXECUTORS = {"self_attention": MemoExecutor, "fpdt": MemoBlockExecutor}


def _plain(ctx: ModelContext, layout: Layout, block: str) -> None:
    return None


def _selective(ctx: ModelContext, layout: Layout, block: str) -> Callable[[], object]:
    return SelectiveExecutor


def _token_wise(ctx: ModelContext, layout: Layout, block: str) -> Callable[[], object]:
    return partial(TOKEN_WISE_EXECUTORS[block], ctx.memo, layout.sp_degree)


def _host_checkpoints(ctx: ModelContext, layout: Layout, block: str) -> Callable[[], object]:
    return partial(CheckpointOffloadExecutor, ctx.checkpoints)


# the executor factory of each executor technique: (the model's context, the layout, the attention block's key)
EXECUTORS = {"plain": _plain, "selective_recompute": _selective, "token_wise_recompute": _token_wise,
             "memo_offload": _token_wise, "host_checkpoints": _host_checkpoints}


def model_spec(cfg: Config, layout: Layout, ctx: ModelContext) -> ModelSpec:
    """The spec of ``cfg``: each slot's class looked up by its technique (``config.resolve_techniques``;
    combinations were refused by ``resolve_layout`` before this point)."""
    t = resolve_techniques(cfg, layout)
    return dataclasses.replace(
        architecture_spec(cfg), attention_block=ATTENTION_BLOCKS[t.attention_block], mlp=MLPS[t.mlp_and_head],
        moe=MOES[t.mlp_and_head], head=HEADS[t.mlp_and_head],
        executor=EXECUTORS[t.executor](ctx, layout, t.attention_block))


def architecture_spec(cfg: Config) -> ModelSpec:
    """The plain model's spec with the norms of ``cfg.model``'s architecture: the norm class (``RMSNorm``,
    Gemma's ``ZeroCenteredRMSNorm`` with ``apply_layernorm_1p``, ``LayerNorm``) for every norm, and for the q/k
    norms and the post norms where the model has them. Example, Gemma 3: ``norm = qk_norm = post_self_attn_norm =
    post_mlp_norm = build_norm("RMSNorm1p", ...)``; Llama: ``norm`` RMSNorm, no q/k norm, no post norms."""
    m = cfg.model
    norm = partial(build_norm, norm_kind(m.normalization, m.apply_layernorm_1p))
    return ModelSpec(norm=norm, qk_norm=norm if m.qk_layernorm else None,
                     post_self_attn_norm=norm if m.post_self_attn_layernorm else no_norm,
                     post_mlp_norm=norm if m.post_mlp_layernorm else no_norm, moe_layers=m.moe_layers())


@dataclass
class ModelParts:
    """What ``model/`` asks for while it is constructed (see module doc)."""

    cfg: Config
    layout: Layout
    topo: Topology
    spec: Optional[ModelSpec] = None  # None: the plain model of the config's architecture (``architecture_spec``)
    ctx: ModelContext = field(default_factory=ModelContext)
    execution: Optional[Execution] = None  # the run's; None: attention kernels chosen by the tensors' device

    def __post_init__(self) -> None:
        if self.spec is None:
            self.spec = architecture_spec(self.cfg)

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

    def expert_dispatcher(self, num_experts: int) -> ExpertDispatcher:
        """An MoE layer's dispatcher: its experts over this rank's expert group (``parallel.expert_model_
        parallel_size``), the identity without one."""
        return ExpertDispatcher(self.topo, num_experts)

    def kernels(self) -> Kernels:
        """The attention kernels of ``parallel.attention_backend`` for the execution's kernel device."""
        return Kernels(self.cfg.parallel.attention_backend,
                       self.execution.kernel_device if self.execution is not None else None)

    def core_attention(self, layer_number: int) -> nn.Module:
        """Layer ``layer_number``'s core attention, with its window (``Layout.window``)."""
        return build_core_attention(self.layout, self.topo, self.kernels(), layer_number)

    def rope_key(self, layer_number: int) -> str:
        """The name of layer ``layer_number``'s RoPE table (``Layout.rope``: theta and whether rope_scaling
        applies), the same for layers that share one: Gemma 3 4B's local layers ``"theta_10000"``, its global ones
        ``"theta_1e+06_scaled"``; ``""`` without RoPE."""
        rope = self.layout.rope(layer_number)
        if rope is None:
            return ""
        scaled = "_scaled" if rope[1] and self.cfg.model.rope_scaling else ""
        return f"theta_{rope[0]:.12g}".replace(".", "_") + scaled
