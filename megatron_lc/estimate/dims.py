"""The sizes the estimator reads: the model's, the layout's degrees and the dtypes' bytes of one run, per rank.

``Dims`` turns a config and a world size into per-rank sizes. Example, Llama3-8B at 1M tokens on 8 GPUs with
tp=2 (sequence parallel), cp=4, micro-batch 1: ``tokens = 1M / 4 = 262144`` per rank go through the linears,
``tokens_residual = tokens / 2 = 131072`` per rank in the residual stream, ``heads_local = 16`` query and
``kv_heads_local = 4`` kv heads per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..config import Config, Layout, resolve_execution
from ..config.layout import kv_replication
from ..config.moe import EXPERT_LOAD, expert_ffn



@dataclass(frozen=True)
class Dims:
    """The model's sizes, the layout's degrees and the dtypes' bytes of one run, as the estimator reads them.

    Example, Llama3-8B at 1M tokens on 8 H100s, tp 2 (sequence parallel) x cp 4, bf16::

        Dims(num_layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256, ...,
             micro_batch=1, seq_length=1048576, tp=2, cp=4, ..., compute_bytes=2, residual_bytes=4)
        .tokens = 262144, .tokens_residual = 131072, .heads_local = 16, .kv_heads_local = 4, .ffn_local = 7168
    """

    num_layers: int
    hidden: int
    ffn: int
    heads: int  # query heads of the model (per tp rank: ``heads_local``)
    kv_heads: int  # kv heads (query groups) of the model
    head_dim: int
    vocab: int  # padded vocab
    swiglu: bool  # a gated MLP, fc1 = [gate; up] (SwiGLU or GeGLU: model.gated_linear_unit; their sizes are equal)
    rmsnorm: bool
    untied_head: bool  # the head's weight is its own (untie_embeddings_and_output_weights)
    learned_positions: int  # max_position_embeddings when learned absolute positions, else 0
    linear_bias: bool
    micro_batch: int
    seq_length: int
    tp: int
    cp: int
    ulysses: int
    dp: int
    sequence_parallel: bool
    cp_comm_type: str
    device: str  # "cuda" | "cpu"
    compute_bytes: int  # bytes of the compute dtype
    residual_bytes: int = 4  # bytes of the residual stream
    micro_batches: int = 1
    fpdt_chunks: int = 1  # u, FPDT's chunks per rank (the layout's)
    doc_length: int = 0  # document masks: the length-weighted mean document length (data.mean_document_length); 0: s
    windows: tuple = ()  # each layer's causal sliding window in tokens (None: full attention; the layout's)
    cp_layout: str = "zigzag"  # the ring ranks' tokens: zigzag or balanced (the layout's, parallel.cp_layout)
    balance_window: Optional[int] = None  # the window the balanced layout weighs tokens by (Layout.balance_window)
    qkv_bias: bool = False  # a bias on the QKV projection (model.add_qkv_bias, or every linear's)
    qk_norm: bool = False  # per-head norms of q and k (model.qk_layernorm)
    post_attn_norm: bool = False  # a norm on the attention block's output (model.post_self_attn_layernorm)
    post_mlp_norm: bool = False  # a norm on the MLP's output (model.post_mlp_layernorm)
    # mixture of experts (model.num_moe_experts; estimate/moe.py): every layer is taken as MoE when any is (an upper
    # bound for the dense layers among them), the FLOPs and parameters count each layer as it is
    experts: int = 0
    topk: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0  # the shared expert's width (0: none)
    shared_gate: bool = False
    moe_layers: tuple = ()  # which layers are MoE
    ep: int = 1  # expert parallelism (parallel.expert_model_parallel_size)
    expert_load: float = 1.0  # the busiest expert rank's rows over its fair share (config.moe.EXPERT_LOAD under ep)

    @classmethod
    def from_config(cls, cfg: Config, layout: Layout, device: str) -> "Dims":
        """The sizes of ``cfg`` under its resolved ``layout`` (``config.resolve_layout``) on ``device`` ("cuda" |
        "cpu"), its dtypes those a run there would resolve (``config.resolve_execution``)."""
        m = cfg.model
        ex = resolve_execution(cfg, torch.device(device))
        learned = m.max_position_embeddings if m.position_embedding_type == "learned_absolute" else 0
        return cls(num_layers=m.num_layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size,
                   heads=m.num_attention_heads, kv_heads=m.num_query_groups, head_dim=m.kv_channels,
                   vocab=m.padded_vocab_size, swiglu=m.gated_linear_unit, rmsnorm=m.normalization == "RMSNorm",
                   untied_head=m.untie_embeddings_and_output_weights, learned_positions=learned,
                   linear_bias=m.add_bias_linear, micro_batch=layout.micro_batch_size, seq_length=layout.seq_length,
                   tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, dp=layout.dp,
                   sequence_parallel=layout.sequence_parallel, cp_comm_type=layout.cp_comm_type, device=device,
                   compute_bytes=ex.compute_dtype.itemsize, residual_bytes=ex.residual_dtype.itemsize,
                   micro_batches=layout.num_micro_batches, fpdt_chunks=layout.fpdt_chunks,
                   doc_length=(cfg.data.mean_document_length or 0) if cfg.data.reset_attention_mask else 0,
                   windows=layout.windows, cp_layout=layout.cp_layout, balance_window=layout.balance_window,
                   qkv_bias=m.add_qkv_bias or m.add_bias_linear, qk_norm=m.qk_layernorm,
                   post_attn_norm=m.post_self_attn_layernorm, post_mlp_norm=m.post_mlp_layernorm,
                   **(_moe_dims(m, layout) if m.num_moe_experts is not None else {}))

    @property
    def moe(self) -> bool:
        return any(self.moe_layers)

    # ---- per-rank sizes ------------------------------------------------------------------------------------
    @property
    def reach(self) -> int:
        """How far back a token's keys go without a window: the sequence, or the mean document length (at most s)."""
        return min(self.doc_length, self.seq_length) if self.doc_length else self.seq_length

    @property
    def attended(self) -> float:
        """Keys a token attends to, counted as the causal formula counts them (twice the mean), the mean over the
        layers: ``s``, or the length-weighted mean document length L under document masks (at most ``s``); a layer
        with a window W < L attends ``2W - W^2/L`` (a document of L tokens has ``W^2/2 + (L - W) W`` pairs, as
        ``config.documents.window_pairs`` counts them). Example: s = 32768, W = 1024 on every layer: 2016."""
        L = self.reach
        per_layer = [L if w is None or w >= L else 2 * w - w * w / L for w in (self.windows or (None,))]
        return sum(per_layer) / len(per_layer)

    @property
    def ranges(self) -> bool:
        """Document masks or a window on some layer: the attention runs rectangles (``attention/ranges.py``)."""
        return bool(self.doc_length) or any(w is not None for w in self.windows)

    @property
    def rects_everywhere(self) -> bool:
        """Every layer's attention runs the rectangles: document masks, or a window on every layer."""
        return bool(self.doc_length) or all(w is not None for w in self.windows or (None,))

    def earlier_chunks(self, n: int) -> float:
        """(q chunk, earlier kv chunk) pairs of ``n`` equal chunks of the sequence that a layer computes and fetches,
        the mean over the layers: all ``n(n-1)/2``, or those within the keys' reach (a window, the documents): q
        chunk i needs ``min(i, ceil(reach / c))`` earlier ones. Example: 16 chunks, a window of one chunk: 15."""
        c = self.seq_length / n
        out = []
        for w in (self.windows or (None,)):
            back = math.ceil(min(self.reach, w if w is not None else self.reach) / c)
            out.append(sum(min(i, back) for i in range(n)))
        return sum(out) / len(out)

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank (after cp) that go through the linears."""
        return self.micro_batch * self.seq_length // self.cp

    @property
    def tokens_residual(self) -> int:
        """Tokens of the residual stream on this rank (split again over tp with sequence parallelism)."""
        return self.tokens // self.tp if self.sequence_parallel else self.tokens

    @property
    def heads_local(self) -> int:
        return self.heads // self.tp

    @property
    def kv_heads_local(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def ffn_local(self) -> int:
        return self.ffn // self.tp

    @property
    def vocab_local(self) -> int:
        return self.vocab // self.tp

    @property
    def fpdt(self) -> bool:
        """FPDT's chunked block replaces attention whenever ``cp_comm_type: fpdt`` (cp = 1: chunks only)."""
        return self.cp_comm_type == "fpdt"

    @property
    def uses_a2a(self) -> bool:
        return self.cp > 1 and self.cp_comm_type in ("a2a", "a2a+p2p", "fpdt")

    @property
    def kv_heads_after_a2a(self) -> int:
        """kv heads per tp rank after replication for the all-to-all (elements per local token / d): Ulysses and
        FPDT copy each kv head ``config.layout.kv_replication`` times."""
        if not self.uses_a2a:
            return self.kv_heads_local
        return self.kv_heads_local * kv_replication(self.heads_local, self.kv_heads_local, self.ulysses)


def _moe_dims(m, layout: Layout) -> dict:
    """The MoE fields of ``Dims`` for model section ``m``."""
    return dict(experts=m.num_moe_experts, topk=m.moe_router_topk, expert_ffn=expert_ffn(m),
                shared_ffn=m.moe_shared_expert_intermediate_size or 0, shared_gate=m.moe_shared_expert_gate,
                moe_layers=m.moe_layers(), ep=layout.ep, expert_load=EXPERT_LOAD if layout.ep > 1 else 1.0)
