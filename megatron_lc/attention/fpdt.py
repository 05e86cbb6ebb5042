"""FPDT attention block (``parallel.cp_comm_type: fpdt``): chunked Ulysses attention with host offload.

``FPDTSelfAttention`` is a ``SelfAttention`` (same ``linear_qkv``/``linear_proj`` modules, so the same parameter
names and the same layout-independent init) whose forward runs the FPDT pipeline of ``fpdt_core``: the QKV
projection, the all-to-all and the attention are done chunk by chunk, so the attention working set is that of one
chunk. ``apply_fpdt(model, cfg, topo)`` swaps it into every layer (called by ``parallel/parallelize.py``).

Example, P = 2 cp ranks (Ulysses), u = 2 chunks, s = 16, 8 heads: rank r holds tokens of pieces r, r+2 (4 tokens
each, ``fpdt_layout``); chunk 0 on rank 0 = tokens 0-3 -> q/k/v [4, b, 8, d] -> all-to-all -> rank 0 holds heads
0-3 of tokens 0-7, rank 1 heads 4-7 of tokens 0-7; chunk 1 = tokens 8-15 likewise; q chunk 1 attends to kv chunk 0
(full) and 1 (causal).

Options (config): ``memory.fpdt_chunk_size`` tokens per gathered chunk (u = seq_length / chunk), ``memory.fpdt_offload``
(q/k/v/out/lse of finished chunks and the projection's saved input on the host; else kept on the device).
P = 1 (cp = 1) with u chunks is valid: chunked attention without communication.

Interface for other memory techniques: the block's forward is ``(x [s, b, h], rope) -> [s, b, h]`` like
``SelfAttention``; it manages its own saved tensors (with offload on, nothing of the block stays on the device
between forward and backward except its output). ``fpdt_account`` is the ``BufferAccount`` its buffers are counted in.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ..config import Config, ConfigError
from ..device import BufferAccount
from ..memory.arena import Arena
from ..model.attention import SelfAttention
from ..parallel.topology import Topology
from .fpdt_buffers import FPDTBuffers
from .fpdt_core import FPDTRun, fpdt_backward, fpdt_forward
from .fpdt_layout import check_fpdt_layout, chunk_rows, sp_degree


def kv_replication(nq: int, nkv: int, ulysses: int) -> int:
    """How many times to repeat each kv head so the all-to-all hands every rank the kv heads of its q heads.

    Rank p gets q heads [p*a, (p+1)*a) (a = nq/P); q head h uses kv head h // g (g = nq/nkv). Repeating each kv
    head r = g / gcd(g, a) times makes every rank's q heads map onto a whole, contiguous block of kv copies.
    Examples: nq=8, nkv=2, P=4 -> r=2 (rank p gets kv copy p = kv head p//2); nkv % P == 0 -> r=1; MQA -> r=P."""
    if nq % ulysses != 0:
        raise ConfigError(f"attention heads per tp rank ({nq}) must be divisible by the Ulysses size ({ulysses})")
    g, a = nq // nkv, nq // ulysses
    return g // math.gcd(g, a)


class _FPDTBlock(torch.autograd.Function):
    """x -> attention output before the output projection, ``[s_local, b, nq*d]`` in chunk-major rows."""

    @staticmethod
    def forward(ctx, x, run: FPDTRun, out_shape, *params):
        out = x.new_empty(out_shape)
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


class FPDTSelfAttention(SelfAttention):
    """SelfAttention with FPDT's chunked forward/backward (see module doc). Built from an existing block."""

    def __init__(self, attn: SelfAttention, cfg: Config, topo: Topology, layer_number: int = 0,
                 account: Optional[BufferAccount] = None, host_account: Optional[BufferAccount] = None):
        nn.Module.__init__(self)
        self.d, self.groups_per_rank, self.q_per_group = attn.d, attn.groups_per_rank, attn.q_per_group
        self.use_rope = attn.use_rope
        self.linear_qkv, self.linear_proj = attn.linear_qkv, attn.linear_proj
        self.topo, self.layer_number = topo, layer_number
        self.num_chunks = check_fpdt_layout(cfg)
        self.sp_tp = sp_degree(cfg)
        self.offload = cfg.memory.fpdt_offload
        self.backend_name = cfg.parallel.attention_backend
        nq = self.groups_per_rank * self.q_per_group
        self.kv_repeat = kv_replication(nq, self.groups_per_rank, topo.ulysses)
        self.fpdt_account = account if account is not None else BufferAccount()
        self.fpdt_host_account = host_account if host_account is not None else BufferAccount()
        self._fpdt_bufs: dict = {}
        self.arena = Arena()  # memory.plan (issue 7): install_arena() replaces it with the planned arena

    def _device_buffers(self, device: torch.device) -> FPDTBuffers:
        if device not in self._fpdt_bufs:
            self._fpdt_bufs[device] = FPDTBuffers(device, self.fpdt_account, self.fpdt_host_account)
        self._fpdt_bufs[device].arena = self.arena
        return self._fpdt_bufs[device]

    def _backend(self, device: torch.device):
        from .backends import get_backend

        name = "auto" if self.backend_name == "te" else self.backend_name  # te has no lse interface here
        return get_backend(name, device)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        u = self.num_chunks
        s_local = x.shape[0] * self.sp_tp
        if x.shape[0] % u != 0 or (s_local // u) % self.sp_tp != 0:
            raise ConfigError(f"FPDT: local sequence ({s_local} tokens on this rank) is not divisible into "
                              f"{u} chunks (memory.fpdt_chunk_size was checked against data.seq_length)")
        params = [p for p in self.linear_qkv.parameters()]
        build_graph = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
        rows = chunk_rows(s_local, u, self.sp_tp)
        rope_chunks = [self._rope_rows(rope, r, i) for i, r in enumerate(rows)]
        keep = {p.untyped_storage().data_ptr() for p in self.parameters()}
        if rope is not None:
            keep |= {t.untyped_storage().data_ptr() for t in rope}
        run = FPDTRun(qkv_fn=self.qkv, topo=self.topo, backend=self._backend(x.device),
                      bufs=self._device_buffers(x.device), num_chunks=u, rope_chunks=rope_chunks,
                      kv_repeat=self.kv_repeat, offload=self.offload, build_graph=build_graph, keep_ptrs=keep, head_dim=self.d, dtype=x.dtype,
                      x_requires_grad=x.requires_grad, tag=f"layer{self.layer_number}.fpdt", params=tuple(params))
        nq = self.groups_per_rank * self.q_per_group
        out = _FPDTBlock.apply(x, run, (s_local, x.shape[1], nq * self.d), *params)
        return torch.cat([self.linear_proj(o) for o in out.chunk(u, dim=0)], dim=0)

    def _rope_rows(self, rope, rows: torch.Tensor, i: int):
        if rope is None:
            return None
        if self.sp_tp == 1:  # contiguous rows: views, nothing copied
            n = rows.numel()
            return tuple(t[i * n:(i + 1) * n] for t in rope)
        return tuple(t.index_select(0, rows.to(t.device)) for t in rope)


class FPDTCoreAttentionPlaceholder(nn.Module):
    """Stands in for core attention while the model is built; ``apply_fpdt`` replaces the whole block."""

    def forward(self, *args):
        raise RuntimeError("FPDT replaces the attention block; call apply_fpdt(model, cfg, topo) after building")


def apply_fpdt(model: nn.Module, cfg: Config, topo: Topology, account: Optional[BufferAccount] = None) -> BufferAccount:
    """Replace every layer's ``self_attention`` by an ``FPDTSelfAttention`` (same parameters). All layers count
    their device buffers in one ``BufferAccount`` (returned, also ``model.fpdt_account``) and their host copies in
    ``model.fpdt_host_account``."""
    account = account if account is not None else BufferAccount()
    host_account = BufferAccount()
    for layer in model.layers:
        layer.self_attention = FPDTSelfAttention(layer.self_attention, cfg, topo, layer.layer_number, account,
                                                 host_account)
    model.fpdt_account, model.fpdt_host_account = account, host_account
    return account
