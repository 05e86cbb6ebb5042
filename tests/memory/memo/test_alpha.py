"""The alpha LP of Memo §4.1 against hand-worked examples, and the profiler that feeds it on this machine.

Paper example (Memo §5.1: A800 nodes, 8 GPUs, 2 TB host, GPU<->CPU 32 GB/s; 7B GPT: h = 4096, 32 layers),
1M tokens, tp = 8 with sequence parallelism, fp16, b = 1. Per GPU and layer (Figure 5: 16*b*s*h elements in all,
of which input 1, attention output 1, others 14, each split over the 8 GPUs):
    S_input = S_attn = 2 B * 2^20 * 4096 / 8 = 1 GiB          S_others = 14 GiB
    T_layer ~ 7.5 s: (2 s^2 h causal attention + 24 s h^2 linears) / 8 GPUs = 1.18e15 FLOP at 156 TFLOP/s (50% MFU)
    M_cpu = 2 TiB / 8 = 256 GiB
    time:   (2 + 14 a) GiB / 32e9 B/s <= 7.5 s   ->  a <= 15.8 (not binding)
    memory: 30 * (2 + 14 a) GiB <= 256 GiB       ->  a <= (256/30 - 2) / 14 = 0.466667   <- alpha*
At 4M tokens on the same 8 GPUs everything is 4x: a <= (256/30 - 8) / 56 = 0.009524; at 8M even a = 0 needs
30 * 16 = 480 GiB > 256 GiB: out of host memory.
"""
import math

import pytest
import torch

from megatron_lc.config import resolve_layout
from megatron_lc.memory.memo.alpha import AlphaInputs, HostMemoryError, check_fixed_alpha, closed_form, solve_alpha
from megatron_lc.memory.memo.profiler import profile_layer
from megatron_lc.units import GIB
from tests.dist_cases.offload import GPT, one_thread  # noqa: F401 (fixture)
from tests.support.parity import build, small_config


def paper(tokens_m: int) -> AlphaInputs:
    k = tokens_m  # everything scales with the sequence length (T_layer kept at the 1M estimate: not binding)
    return AlphaInputs(s_input=k * GIB, s_attn=k * GIB, s_others=14 * k * GIB, bandwidth=32e9, t_layer=7.5,
                       num_layers=32, host_budget=2 * 1024 * GIB / 8)


def test_paper_7b_1m_tokens_is_host_memory_bound():
    r = solve_alpha(paper(1))
    assert r.alpha == pytest.approx((256 / 30 - 2) / 14, abs=1e-6) == pytest.approx(0.466667, abs=1e-6)
    assert r.binding == "memory" and r.hidden
    assert r.time_bound == pytest.approx((32e9 * 7.5 - 2 * GIB) / (14 * GIB))
    assert r.host_bytes == pytest.approx(256 * GIB, rel=1e-6)  # the budget is exactly used up
    assert r.alpha == pytest.approx(closed_form(paper(1)), abs=1e-9)


def test_paper_7b_4m_and_8m_tokens():
    assert solve_alpha(paper(4)).alpha == pytest.approx((256 / 30 - 8) / 56, abs=1e-6)
    with pytest.raises(HostMemoryError, match=r"30 swapped layers need 480.00 GiB.*budget 256.00 GiB"):
        solve_alpha(paper(8))
    assert closed_form(paper(8)) is None


def test_time_bound():
    # (2 + 8a) GiB / 10 GiB/s <= 0.6 s  ->  a <= 0.5; host plentiful
    inp = AlphaInputs(s_input=GIB, s_attn=GIB, s_others=8 * GIB, bandwidth=10 * GIB, t_layer=0.6, num_layers=10,
                      host_budget=1e6 * GIB)
    r = solve_alpha(inp)
    assert r.alpha == pytest.approx(0.5, abs=1e-6) and r.binding == "time" and r.hidden
    assert r.transfer_seconds == pytest.approx(0.6)
    assert r.host_bytes == pytest.approx(8 * 6 * GIB)


def test_time_infeasible_gives_zero_not_an_error():
    # input + attention output alone take 0.2 s to copy, the layer computes in 0.1 s: alpha 0, copy not hidden
    inp = AlphaInputs(s_input=GIB, s_attn=GIB, s_others=8 * GIB, bandwidth=10 * GIB, t_layer=0.1, num_layers=10,
                      host_budget=1e6 * GIB)
    r = solve_alpha(inp)
    assert r.alpha == 0.0 and not r.hidden and r.binding == "time"
    assert closed_form(inp) == 0.0


def test_everything_fits_and_two_layers_need_no_host():
    inp = AlphaInputs(s_input=1, s_attn=1, s_others=14, bandwidth=1e9, t_layer=1.0, num_layers=32, host_budget=1e9)
    assert solve_alpha(inp).alpha == 1.0 and solve_alpha(inp).binding == "one"
    two = AlphaInputs(s_input=GIB, s_attn=GIB, s_others=14 * GIB, bandwidth=1e12, t_layer=1.0, num_layers=2,
                      host_budget=0.0)
    r = solve_alpha(two)
    assert r.alpha == 1.0 and r.host_bytes == 0.0  # the last two layers are never swapped


def test_fixed_alpha_checked_against_host():
    assert check_fixed_alpha(paper(1), 0.25).host_bytes == pytest.approx(30 * 5.5 * GIB)
    with pytest.raises(HostMemoryError, match=r"offload_fraction \(0.5\) needs 270.00 GiB.*largest.*0.4667"):
        check_fixed_alpha(paper(1), 0.5)


@pytest.mark.parametrize("seed", range(20))
def test_linprog_equals_closed_form(seed):
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(6, generator=g).tolist()
    inp = AlphaInputs(s_input=u[0] * GIB, s_attn=u[1] * GIB, s_others=(0.1 + 10 * u[2]) * GIB,
                      bandwidth=(1 + 30 * u[3]) * GIB, t_layer=0.05 + u[4], num_layers=3 + int(60 * u[5]),
                      host_budget=(20 + 200 * u[4]) * GIB)
    cf = closed_form(inp)
    if cf is None:
        with pytest.raises(HostMemoryError):
            solve_alpha(inp)
    else:
        assert solve_alpha(inp).alpha == pytest.approx(cf, abs=1e-7)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("arch", ["llama", "gpt"])
def test_profiler_on_this_machine(arch):
    """Sizes measured by the profiler equal the per-layer formula of docs/memo_offload.md; time, bandwidth and
    host memory are measured (positive, finite)."""
    # token-wise recompute: the layers run under a MemoExecutor, whose measuring twin the profiler uses
    cfg = small_config((GPT if arch == "gpt" else []) + ["memory.recompute_granularity=full"])
    model, _ = build(cfg)
    p, _ = profile_layer(model, resolve_layout(cfg, 1), torch.device("cpu"), None, torch.float32, repeats=2)
    m = cfg.model
    rows, e = 32 * 2, 4  # tokens x batch, fp32
    h, f, nqd, nkvd = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads * m.kv_channels, \
        m.num_query_groups * m.kv_channels
    # Llama (model/norm.py's RMSNorm saves input + rstd, as a fused kernel; SwiGLU saves fc1 out, silu(gate), product)
    per_row = 3 * h + 2 + nqd + 2 * nkvd + 4 * f if arch == "llama" else 3 * h + 4 + nqd + 2 * nkvd + 2 * f
    assert p.s_input == rows * h * e
    assert p.s_attn == rows * nqd * e + 2 * m.num_attention_heads * 32 * 4  # + lse [b, nq, s] fp32
    assert p.s_others == rows * per_row * e
    for v in (p.t_layer, p.bw_d2h, p.bw_h2d, p.host_budget):
        assert math.isfinite(v) and v > 0
    assert p.ranks_per_node == 1 and p.tokens == 32
