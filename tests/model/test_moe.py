"""The MoE block (model/moe.py) in one process: the grouped matmul against a loop over the experts, the router
z-loss's gradient against autograd of its formula, the MsT mini-sequences against the whole block."""
from __future__ import annotations

import torch

from megatron_lc.model.moe import grouped_linear
from tests.support.parity import build, small_config

MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32"]


def test_grouped_linear_is_the_loop_over_experts():
    """``torch._grouped_mm`` (16-byte rows) and the fallback loop (odd widths) against one matmul per expert,
    empty experts included: the same fp32 products, bit for bit on the CPU."""
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])
    for width in (16, 6):  # 64-byte rows: the grouped matmul; 24-byte rows: the loop
        rows = torch.randn(10, width, generator=g, requires_grad=True)
        w = torch.randn(4, 12, width, generator=g, requires_grad=True)
        out = grouped_linear(rows, w, counts)
        ref = torch.cat([r @ w[e].t() for e, r in enumerate(rows.split(counts.tolist()))])
        assert torch.equal(out, ref)
        dy = torch.randn_like(out)
        got = torch.autograd.grad(out, (rows, w), dy)
        want = torch.autograd.grad(ref, (rows, w), dy)
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-6


def _grads(overrides, explicit_z=0.0):
    cfg = small_config(MOE + list(overrides))
    model, ctx = build(cfg)
    seen = []
    for layer in model.layers:
        layer.mlp.router.register_forward_hook(lambda mod, args, out: seen.append(out))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    loss = model(tokens, torch.arange(32).expand(2, 32), tokens).mean()
    if explicit_z:  # Megatron-LM's: per layer coeff * mean(logsumexp^2), summed over the layers
        loss = loss + explicit_z * sum(torch.logsumexp(z.float(), -1).square().mean() for z in seen)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, ctx


def test_z_loss_gradient_is_its_formulas():
    got, ctx = _grads(["model.moe_z_loss_coeff=0.05"])
    ref, _ = _grads([], explicit_z=0.05)
    for n in ref:
        assert (got[n] - ref[n]).abs().max() <= 1e-7, n
    assert float(ctx.routing.z_loss()) > 0


def test_mini_sequence_moe_is_the_whole_block():
    """MsT's chunks of 8 tokens (8 chunks of the 64 rows) give the whole block's gradients, the load-balancing
    loss's included (its counts recorded once, by the forward: not again when a chunk is re-made in backward)."""
    over = ["model.moe_aux_loss_coeff=0.1", "memory.mst_mlp_chunk_size=8"]
    whole, ctx = _grads(over)
    chunked, ctx_mst = _grads(over + ["memory.mst=true"])
    assert torch.equal(ctx.routing.total[:4], ctx_mst.routing.total[:4])  # the counts: each row once
    assert torch.allclose(ctx.routing.total, ctx_mst.routing.total, rtol=1e-6)
    for n in whole:
        assert (whole[n] - chunked[n]).abs().max() <= 1e-6, n
