"""Rank functions for tests/attention/test_cp_attention.py and tests/parallel/test_cp_*.py (run under
tests.support.dist.run_dist).

Tolerances (fp32 on CPU). Core attention: the reference is SDPA on the full sequence; the parallel result differs
only by the blockwise softmax (merged by lse in fp32) and by sums of dk/dv split over ranks, each ~1e-7 relative
per operation on values of order 1, so outputs agree to ~1e-6 and we assert 2e-5 (out) and 1e-4 (grads, the
project's contract). Model: see tests/support/parity.py (loss 1e-5 relative, grads 1e-4 absolute)."""
from __future__ import annotations

import copy

import torch

from megatron_lc.attention import build_core_attention
from megatron_lc.attention.local import LocalCausalAttention
from megatron_lc.config import ConfigError, resolve_layout
from megatron_lc.parallel.token_layout import local_token_index, shard_batch
from megatron_lc.parallel.topology import Topology
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, full_grads,
                          reference_loss_and_grads, small_config)

OUT_ATOL = 2e-5
GRAD_ATOL = 1e-4

def cp_overrides(kind: str, cp: int, ulysses: int | None = None, tp: int = 1) -> list[str]:
    o = [f"parallel.context_parallel_size={cp}", f"parallel.cp_comm_type={kind}",
         f"parallel.tensor_model_parallel_size={tp}"]
    if ulysses is not None:
        o.append(f"parallel.ulysses_size={ulysses}")
    return o


def _qkv(seed: int, s: int, b: int, nq: int, nkv: int, d: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (nq, nkv, nkv))
    dout = torch.randn(s, b, nq, d, generator=g)
    return q, k, v, dout


def attention_parity(rank, world, kind, ulysses, nq, nkv, b, s, d):
    """Core attention of ``kind`` over cp=world vs SDPA on the full sequence: out, dq, dk, dv; returns bytes."""
    cfg = small_config(cp_overrides(kind, world, ulysses) + [
        f"model.num_attention_heads={nq}", f"model.num_query_groups={nkv}", f"model.kv_channels={d}",
        f"data.seq_length={s}", f"model.hidden_size={nq * d}"])
    layout = resolve_layout(cfg, world)
    topo = Topology.build(cp=world, ulysses=cfg.parallel.ulysses_size)
    q, k, v, dout = _qkv(0, s, b, nq, nkv, d)

    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = LocalCausalAttention()(*ref_in)
    ref_out.backward(dout)

    idx = local_token_index(layout, topo, s)
    loc = [t.index_select(0, idx).clone().requires_grad_(True) for t in (q, k, v)]
    attn = build_core_attention(layout, topo, "auto", layer_number=0)
    out = attn(*loc)
    out.backward(dout.index_select(0, idx))

    err = (out - ref_out.detach().index_select(0, idx)).abs().max().item()
    assert err <= OUT_ATOL, f"rank {rank}: out max abs diff {err:.3e} > {OUT_ATOL}"
    for name, got, ref in zip("qkv", loc, ref_in):
        err = (got.grad - ref.grad.index_select(0, idx)).abs().max().item()
        assert err <= GRAD_ATOL, f"rank {rank}: d{name} max abs diff {err:.3e} > {GRAD_ATOL}"
    return {op: topo.comm.total(tag="layer0.attn", op=op) for op in ("p2p_fwd", "p2p_bwd", "a2a_fwd", "a2a_bwd")}


def odd_local_length(rank, world):
    """A ring rank given an odd number of local tokens (cannot hold two zigzag chunks) refuses clearly."""
    cfg = small_config(cp_overrides("p2p", world))
    topo = Topology.build(cp=world)
    attn = build_core_attention(resolve_layout(cfg, world), topo, "auto", layer_number=0)
    q = torch.randn(5, 1, 8, 8)
    try:
        attn(q, q[:, :, :4], q[:, :, :4])
    except ConfigError as e:
        return str(e)
    raise AssertionError("ring attention accepted an odd local length")


def _masked_batch(cfg, seed=0, batch=2):
    """A batch whose loss mask is uneven across the sequence (so cp ranks hold different valid-token counts: a
    mean of per-rank means would differ from the global mean)."""
    b = batch_for(cfg, seed=seed, batch=batch)
    s = cfg.data.seq_length
    mask = torch.ones(batch, s)
    mask[0, : s // 3] = 0.0  # the first third of sample 0 does not count
    mask[1, 5::7] = 0.0
    b["loss_mask"] = mask
    return b


def model_parity(rank, world, overrides):
    """Full model with cp (and possibly tp) vs the single-process model: global loss and every gradient."""
    from megatron_lc.parallel.collectives import all_reduce
    from megatron_lc.parallel.topology import Axis
    from megatron_lc.training.optimizer import sync_gradients

    cfg = small_config(list(overrides))
    layout = resolve_layout(cfg, world)
    p = cfg.parallel
    batch = _masked_batch(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(copy.deepcopy(cfg), batch)

    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size)
    model = build(cfg, topo)[0]
    local = shard_batch(batch, layout, topo)
    total = batch["loss_mask"].sum()  # the loop all-reduces the local counts over dp x cp to get this
    count = local["loss_mask"].sum().double()
    all_reduce(count, topo, Axis.DP_CP)
    assert float(count) == float(total)
    tok_loss = model(local["tokens"], local["position_ids"], local["labels"])
    loss = (tok_loss * local["loss_mask"]).sum() / total
    loss.backward()
    sync_gradients(model, topo)
    gl = loss.detach().double()
    all_reduce(gl, topo, Axis.CP)
    assert_close_loss(float(gl), ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return float(gl)


def train_losses(rank, world, config_path, overrides, metrics_file):
    """Losses of a short Trainer run of ``config_path`` with ``overrides``."""
    from megatron_lc.config import load_config
    from megatron_lc.training.loop import Trainer

    cfg = load_config(config_path, list(overrides) + [f"logging.metrics_file={metrics_file}"])
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    return Trainer(cfg, topo, layout=layout).train().losses


class _BlockWatch:
    """A CPU attention backend that checks, at each off-diagonal block's kernel, that the previous such block's
    outputs are gone (merged or accumulated, not held through the next kernel: under the fused CUDA kernels a
    block's dk, dv are nq-headed and k, v repeated, so a stale block is a whole working set)."""

    def __init__(self):
        import weakref
        from megatron_lc.attention.backends import get_backend
        self.inner, self.ref, self.prev, self.calls = get_backend("auto", torch.device("cpu")), weakref.ref, [], 0

    def _watch(self, causal, run):
        if causal:  # (the diagonal block's outputs are the accumulators)
            return run()
        assert all(w() is None for w in self.prev), "the previous block's outputs are alive at the next kernel"
        outs = run()
        self.prev = [self.ref(t) for t in outs]
        self.calls += 1
        return outs

    def forward(self, q, k, v, causal, scale=None):
        return self._watch(causal, lambda: self.inner.forward(q, k, v, causal, scale))

    def backward(self, dout, q, k, v, out, lse, causal, scale=None):
        return self._watch(causal, lambda: self.inner.backward(dout, q, k, v, out, lse, causal, scale))


def ring_blocks_released(rank, world):
    """ring_forward / ring_backward on ``world`` ranks with ``_BlockWatch``; returns its off-diagonal calls."""
    from megatron_lc.attention.ring import RingComm, ring_backward, ring_forward
    topo = Topology.build(cp=world)
    comm = RingComm(topo)
    q, k, v, dout = (t.permute(1, 2, 0, 3).contiguous() for t in _qkv(rank, 8, 1, 4, 2, 8))  # [b, n, 2c, d]
    watch = _BlockWatch()
    out, lse = ring_forward(q, k, v, comm, watch)
    watch.prev = []
    ring_backward(dout, q, k, v, out.to(q.dtype), lse, comm, watch)
    return watch.calls
