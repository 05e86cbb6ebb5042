"""Rank functions for tests/attention/test_fpdt.py (run under tests.support.dist.run_dist).

Tolerances (fp32, CPU): FPDT changes only the order of floating-point work -- the softmax over a row is split over
kv chunks and merged by log-sum-exp in fp32, the weight gradients are sums over chunks and ranks instead of one
matmul. Each merge or partial sum adds ~1 ulp (6e-8) relative error; with at most 4 chunks and 4 ranks the outputs
(|o| <= ~1) differ by ~1e-6, so OUT_ATOL = 1e-5 leaves a 10x margin; gradients use the project contract 1e-4
(parity.GRAD_ATOL), losses 1e-5 relative (parity.LOSS_RTOL)."""
from __future__ import annotations

import torch

from megatron_lc.attention.backends import Kernels
from megatron_lc.attention.fpdt.block import FPDTSelfAttention
from megatron_lc.attention.fpdt.host_share import reserve_for_layers
from megatron_lc.config import resolve_layout
from megatron_lc.model.attention import SelfAttention
from megatron_lc.model.rope import RotaryEmbedding
from megatron_lc.parallel.collectives import all_reduce
from megatron_lc.parallel.token_layout import fpdt_token_index, shard_batch
from megatron_lc.parallel.topology import Axis, Topology
from tests.support.parity import (GRAD_ATOL, assert_close_grads, assert_close_loss, batch_for, block_parts, build,
                                  full_grads, reference_loss_and_grads, small_config)

OUT_ATOL = 1e-5


def _block_case(topo: Topology, P: int, u: int, nq: int, nkv: int, offload: bool, backend: str, seq: int = 32,
                batch: int = 2) -> dict:
    """One FPDT block on this rank vs the plain SelfAttention on the full sequence (same weights)."""
    over = [f"model.num_attention_heads={nq}", f"model.num_query_groups={nkv}", f"data.seq_length={seq}"]
    ref_cfg = small_config(over)
    cfg = small_config(over + [f"parallel.context_parallel_size={P}", "parallel.cp_comm_type=fpdt",
                               f"memory.fpdt_chunk_size={seq // u}", f"memory.fpdt_offload={offload}"])
    torch.manual_seed(1)  # same weights and inputs on every rank
    ref = SelfAttention(ref_cfg.model, block_parts(ref_cfg), 0, 0.02)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    parts = block_parts(cfg, topo)
    block = FPDTSelfAttention(cfg.model, parts, 0, 0.02)
    block.load_state_dict(ref.state_dict())
    block.kernels = Kernels(backend)  # "math" is not a config choice (reference kernel), set it directly
    h = ref_cfg.model.hidden_size
    x = torch.randn(seq, batch, h, requires_grad=True)
    w = torch.randn(seq, batch, h)
    rope = RotaryEmbedding(ref_cfg.model.kv_channels, 10000.0)(torch.arange(seq).view(seq, 1).expand(seq, batch))
    ref_out = ref(x, rope)
    (ref_out * w).sum().backward()

    idx = fpdt_token_index(seq, P, topo.cp_rank, u)
    x_loc = x.detach()[idx].clone().requires_grad_(True)
    if offload:  # the host pool: one block's parked chunks, measured (attention/fpdt/host_share.py)
        reserve_for_layers(block, x_loc.detach(), tuple(t[idx] for t in rope), 1)
    out = block(x_loc, tuple(t[idx] for t in rope))
    err_out = (out - ref_out.detach()[idx]).abs().max().item()
    assert err_out <= OUT_ATOL, f"P={P} u={u} heads {nq}/{nkv} offload={offload}: output diff {err_out:.2e}"
    (out * w[idx]).sum().backward()
    err_dx = (x_loc.grad - x.grad[idx]).abs().max().item()
    assert err_dx <= GRAD_ATOL, f"P={P} u={u} heads {nq}/{nkv} offload={offload}: dx diff {err_dx:.2e}"
    ref_grads = dict(ref.named_parameters())
    for name, p in block.named_parameters():  # weights are replicated over cp: sum the ranks' partial grads
        g = all_reduce(p.grad.clone(), topo, Axis.CP)
        err = (g - ref_grads[name].grad).abs().max().item()
        # relative to the largest entry: with std-0.2 weights the weight gradients reach ~1e2 (linear_qkv 117 for
        # MQA), where fp32 re-association over chunks and ranks leaves ~1e-4 absolute (9e-7 relative) on some CPUs
        scale = max(1.0, ref_grads[name].grad.abs().max().item())
        assert err <= GRAD_ATOL * scale, f"P={P} u={u} heads {nq}/{nkv} offload={offload}: grad {name} diff {err:.2e}"
    acct, host = parts.ctx.fpdt.account, parts.ctx.fpdt.host_account
    assert acct.current == 0, f"FPDT buffers not all released: {acct.summary()}"
    assert host.current == 0, f"FPDT host copies not all released: {host.summary()}"
    d = ref_cfg.model.kv_channels
    kv_chunk = 2 * batch * (nkv * block.kv_repeat // P) * (seq // u) * d * 4  # one gathered k + v chunk, fp32
    fetched_kv = acct.peak_by_tag.get("fpdt.fetch_kv", 0)
    if offload:  # double buffer: the kv chunk in use and the next one, never more
        assert 0 < fetched_kv <= 2 * kv_chunk or (u == 1 and fetched_kv == kv_chunk), (fetched_kv, kv_chunk)
        assert acct.peak_by_tag.get("fpdt.saved", 0) == 0 and host.peak > 0
    else:
        assert fetched_kv == 0 and host.peak == 0
    return {"out": err_out, "dx": err_dx, "peak": acct.peak, "by_tag": dict(acct.peak_by_tag)}


def block_parity(rank, world, cases):
    """``cases``: list of (u, nq, nkv, offload, backend); P = world."""
    topo = Topology.build(cp=world, ulysses=world)
    return [_block_case(topo, world, *c) for c in cases]


def _sharded_loss_backward(model, batch, cfg, topo):
    """This rank's share of the global mean token loss (normalised by the global count, as training/loop.py)."""
    b = shard_batch(batch, resolve_layout(cfg, topo.world_size), topo)
    tok = model(b["tokens"], b["position_ids"], b["labels"])
    count = batch["loss_mask"].sum()  # every rank sees the full batch here: the global count
    local = (tok * b["loss_mask"]).sum() / count
    local.backward()
    total = all_reduce(local.detach().clone(), topo, Axis.CP)
    return float(total)


def model_parity(rank, world, overrides, tp=1):
    """The whole model with FPDT (cp = world / tp) vs the plain single-process model: loss and every gradient."""
    from megatron_lc.training.optimizer import sync_gradients

    cp = world // tp
    cfg = small_config([f"parallel.tensor_model_parallel_size={tp}", f"parallel.context_parallel_size={cp}",
                        "parallel.cp_comm_type=fpdt"] + list(overrides))
    batch = batch_for(cfg)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    topo = Topology.build(tp=tp, cp=cp, ulysses=cp)
    model = build(cfg, topo)[0]
    loss = _sharded_loss_backward(model, batch, cfg, topo)
    sync_gradients(model, topo)
    assert_close_loss(loss, ref_loss)
    assert_close_grads(full_grads(model, topo), ref_grads)
    return loss


def train_losses(rank, world, overrides):
    """Losses of ``train.train_iters`` steps of the real training loop (``Trainer``)."""
    from megatron_lc.config import load_config
    from megatron_lc.training.loop import Trainer

    cfg = load_config("configs/tiny_cpu_fpdt.yaml", list(overrides))
    p = cfg.parallel
    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size,
                          world_size=world)
    return Trainer(cfg, topo).train().losses
