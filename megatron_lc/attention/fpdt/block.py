"""FPDT attention block (``parallel.cp_comm_type: fpdt``): chunked Ulysses attention with host offload (the FPDT
paper, section 4).

``FPDTSelfAttention`` has the projections of ``SelfAttention`` (same ``linear_qkv``/``linear_proj``, so the same
parameter names and the same layout-independent init) and, instead of a core attention, runs the pipeline of
``pipeline.py``: the QKV projection, the all-to-all and the attention are done chunk by chunk, so the attention
working set is that of one chunk. The model spec constructs it in every layer (``compose/spec.py``).

Example, P = 2 cp ranks (Ulysses), u = 2 chunks, s = 16, 8 heads: rank r holds tokens of pieces r, r+2 (4 tokens
each, ``parallel/token_layout.py``); chunk 0 on rank 0 = tokens 0-3 -> q/k/v [4, b, 8, d] -> all-to-all -> rank 0
holds heads 0-3 of tokens 0-7, rank 1 heads 4-7 of tokens 0-7; chunk 1 = tokens 8-15 likewise; q chunk 1 attends to
kv chunk 0 (full) and 1 (causal).

Options (config): ``memory.fpdt_chunk_size`` tokens per gathered chunk (u = seq_length / chunk, in the layout),
``memory.fpdt_offload`` (q/k/v/out/lse of finished chunks and the projection's saved input on the host; else kept on
the device). P = 1 (cp = 1) with u chunks is valid: chunked attention without communication.

Interface for other memory techniques: the block's forward is ``(x [s, b, h], rope) -> [s, b, h]`` like
``SelfAttention``; it manages its own saved tensors (with offload on, nothing of the block stays on the device
between forward and backward except its output). Its buffers are counted in the model context's ``FPDTRuntime``.
``attend(x, rope, documents, norm)`` is the block before its out-projection, with the layer's norm 1 run inside
each chunk's projection: the attention of the host checkpoints' chunked layer (``memory/chunked_layer.py``), which
hands it the layer input and runs the out-projection, residual and MLP in mini-sequences of the block's rows.
"""
from __future__ import annotations

from functools import partial

import torch

from ...config import ConfigError, ModelConfig
from ...device import storage_id
from ...model.attention import AttentionProjections
from ...parallel.token_layout import chunk_rows
from .pipeline import FPDTRun, fpdt_backward, fpdt_forward


class _FPDTBlock(torch.autograd.Function):
    """x -> attention output before the output projection, ``[s_local, b, nq*d]`` in chunk-major rows."""

    @staticmethod
    def forward(ctx, x, run: FPDTRun, out_shape, *params):
        dev = x.device.type  # the output in the compute dtype (bf16 under autocast), so dout is too
        out = x.new_empty(out_shape, dtype=torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype)
        with run.topo.comm.tag(run.tag):
            fpdt_forward(run, x, out)
        ctx.run, ctx.x_shape, ctx.x_dtype = run, x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        run = ctx.run
        with run.topo.comm.tag(run.tag):
            dx = fpdt_backward(run, dout.contiguous(), ctx.x_shape, ctx.x_dtype)
        ctx.run = None
        return (dx, None, None) + (None,) * len(run.params)


def _normed_qkv(qkv, norm, x: torch.Tensor, rope):
    """One chunk's q, k, v from the layer input: ``norm`` (norm 1) then the block's projection."""
    return qkv(norm(x), rope)


class FPDTSelfAttention(AttentionProjections):
    """The FPDT attention block (see module doc); constructed by the model spec like ``SelfAttention``."""

    def __init__(self, cfg: ModelConfig, parts, layer_number: int, output_std: float):
        super().__init__(cfg, parts, output_std)
        layout = parts.layout
        self.topo, self.layer_number = parts.topo, layer_number
        self.num_chunks, self.sp_tp = layout.fpdt_chunks, layout.sp_degree
        self.kv_repeat = layout.kv_replication
        self.offload = parts.cfg.memory.fpdt_offload
        self.window = layout.window(layer_number)  # the layer's causal sliding window (None: full attention)
        self.kernels = parts.kernels()
        self.state = parts.ctx.fpdt  # shared by the layers: accounts, per-device buffers and streams, arena

    def forward(self, x: torch.Tensor, rope, documents=None, norm=None) -> torch.Tensor:
        out = self.attend(x, rope, documents, norm)
        return torch.cat([self.linear_proj(o) for o in out.chunk(self.num_chunks, dim=0)], dim=0)

    def attend(self, x: torch.Tensor, rope, documents=None, norm=None) -> torch.Tensor:
        """The attention output before ``linear_proj``, ``[s_local, b, nq*d]`` in chunk-major rows (chunk i: rows
        ``[i*c, (i+1)*c)``, c = s_local / u, its tp blocks gathered with SP), with autograd when grad is enabled.
        ``norm``: a row-wise module run on each chunk of ``x`` inside the chunk's projection graph (the layer's
        norm 1: the block then reads the layer input, and no normed copy of the whole sequence exists; what the
        norm saves is parked with the rest of the projection's saved tensors)."""
        u = self.num_chunks
        s_local = x.shape[0] * self.sp_tp
        if x.shape[0] % u != 0 or (s_local // u) % self.sp_tp != 0:
            raise ConfigError(f"FPDT: local sequence ({s_local} tokens on this rank) is not divisible into "
                              f"{u} chunks (memory.fpdt_chunk_size was checked against data.seq_length)")
        params = [p for p in self.linear_qkv.parameters()] + ([] if norm is None else list(norm.parameters()))
        build_graph = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        rows = chunk_rows(s_local, u, self.sp_tp)
        rope_chunks = [self._rope_rows(rope, r, i) for i, r in enumerate(rows)]
        keep = {storage_id(p) for p in params} | {storage_id(p) for p in self.parameters()}
        if rope is not None:
            keep |= {storage_id(t) for t in rope}
        qkv_fn = self.qkv if norm is None else partial(_normed_qkv, self.qkv, norm)
        run = FPDTRun(qkv_fn=qkv_fn, topo=self.topo, backend=self.kernels(x.device),
                      bufs=self.state.buffers(x.device), num_chunks=u, rope_chunks=rope_chunks,
                      kv_repeat=self.kv_repeat, offload=self.offload, build_graph=build_graph, keep_ptrs=keep,
                      head_dim=self.d, dtype=x.dtype, x_requires_grad=x.requires_grad,
                      tag=f"layer{self.layer_number}.fpdt", params=tuple(params), documents=documents,
                      window=self.window)
        nq = self.groups_per_rank * self.q_per_group
        return _FPDTBlock.apply(x, run, (s_local, x.shape[1], nq * self.d), *params)

    def _rope_rows(self, rope, rows: torch.Tensor, i: int):
        if rope is None:
            return None
        if self.sp_tp == 1:  # contiguous rows: views, nothing copied
            n = rows.numel()
            return tuple(t[i * n:(i + 1) * n] for t in rope)
        return tuple(t.index_select(0, rows.to(t.device)) for t in rope)
