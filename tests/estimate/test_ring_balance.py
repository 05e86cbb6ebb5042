"""The time model sees the ring's layout under packed documents (``estimate/ring_balance.py``): the attention of the
slowest ring rank, and the bytes the balanced layout's plan sends; ``--auto`` weighs the layouts with it."""
from __future__ import annotations

import pytest

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.estimate import estimate, load_hardware
from megatron_lc.estimate.dims import Dims
from megatron_lc.estimate.ring_balance import ring_balance
from megatron_lc.estimate.time_estimate import layer_comm

DOCS = ["data.mean_document_length=65536", "data.reset_attention_mask=true"]


def _est(over, hw=None):
    cfg = load_config("configs/llama3_8b_1m.yaml", DOCS + list(over))
    return estimate(cfg, hw or load_hardware("h100"), 8)


def test_the_zigzag_waits_for_its_slowest_rank_and_the_balanced_layout_does_not():
    """1M on a ring of 8, 64K documents: the zigzag's slowest rank runs ~2x the mean attention (the bench's
    1.87-2.01), the balanced layout's 1.00; the attention seconds scale by exactly that, the linears not."""
    bal, zig = _est([]), _est(["parallel.cp_layout=zigzag"])
    b, z = ring_balance(bal.dims), ring_balance(zig.dims)
    assert b.imbalance < 1.001 and 1.8 < z.imbalance < 2.2, (b, z)
    assert z.rows == z.ring_rows == 7 * 131072 and b.rows < z.rows / 3
    causal = _est(["data.reset_attention_mask=false"])
    fwd = {name: e.time.parts["forward compute"] for name, e in (("bal", bal), ("zig", zig), ("causal", causal))}
    # forward compute = linears + attention: the linears the same in both, the attention z.imbalance times
    attention = (fwd["zig"] - fwd["bal"]) / (z.imbalance / b.imbalance - 1)
    assert 0 < attention < fwd["bal"] and zig.time.step_seconds > 1.3 * bal.time.step_seconds
    assert causal.time.step_seconds > bal.time.step_seconds  # 64K documents attend less than one 1M sequence


def test_the_balanced_exchange_is_charged_its_plans_bytes():
    """On a link slow enough to expose it, the balanced layout's cp communication is its plan's rows (the slowest
    receiver's) less what the blocks after the diagonal hide: forward k, v in bf16, backward also fp32 dk, dv."""
    hw = load_hardware("h100", {"nvlink_gbps": 1.0})
    est = _est([], hw)
    d, b = est.dims, ring_balance(est.dims)
    comm = layer_comm(d, hw, 0.0, 0.0)  # no attention to hide behind
    row = 2 * d.micro_batch * d.kv_heads_after_a2a * d.head_dim
    bw = hw.link_bytes_per_s(8, 1)
    assert comm["cp_fwd"] == pytest.approx(b.rows * row * 2 / bw)
    assert comm["cp_bwd"] == pytest.approx(b.rows * row * (2 + 4) / bw)
    zig = _est(["parallel.cp_layout=zigzag"], hw)
    assert layer_comm(zig.dims, hw, 0.0, 0.0)["cp_fwd"] == pytest.approx(7 * 131072 * row * 2 / bw)


def test_without_documents_the_ring_is_the_causal_zigzag():
    cfg = load_config("configs/llama3_8b_1m.yaml")
    d = Dims.from_config(cfg, resolve_layout(cfg, 8), "cuda")
    b = ring_balance(d)
    assert b.imbalance == 1.0 and b.rows == b.ring_rows
    ulysses = load_config("configs/llama3_8b_1m.yaml", DOCS + ["parallel.cp_comm_type=a2a", "parallel.ulysses_size=8"])
    assert ring_balance(Dims.from_config(ulysses, resolve_layout(ulysses, 8), "cuda")) is None
