"""T1: the attention kernels every (out, lse) path uses on this device -- out, lse, dq, dk, dv against an fp64
reference, for MHA / GQA / MQA, head dim 64 / 128, causal or not, keys split into 1-4 blocks merged by lse (as the
ring merges them), backward from the merged out and lse. bf16 within 1e-2 relative (to the largest reference
entry), fp32 within 1e-4. Then fwd+bwd time against ``F.scaled_dot_product_attention`` at 32K tokens (<= 1.1x).
Documents and a window as rectangles (the variable-length kernel in bf16) against the fp64 dense masked reference."""
import time

import pytest
import torch
import torch.nn.functional as F

from megatron_lc.attention.backends import Kernels, get_backend, missing
from megatron_lc.attention.merge import merge
from megatron_lc.attention.ranges import block_rects, spans
from megatron_lc.config.documents import DocumentRanges
from tests.gpu.conftest import DRYRUN

TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}


def reference(q, k, v, dout, causal):
    """fp64 out, lse and gradients (math, with GQA expanded)."""
    r = q.shape[1] // k.shape[1]
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ke, ve = k64.repeat_interleave(r, 1), v64.repeat_interleave(r, 1)
    s = q64 @ ke.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ ve
    out.backward(dout.double())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def blocked(backend, q, k, v, dout, causal, blocks):
    """Forward over ``blocks`` key blocks merged by lse, backward per block from the merged out and lse."""
    if causal or blocks == 1:
        out, lse = backend.forward(q, k, v, causal)
        return (out, lse, *backend.backward(dout, q, k, v, out, lse, causal))
    ks, vs = k.chunk(blocks, 2), v.chunk(blocks, 2)
    out = lse = None
    for kb, vb in zip(ks, vs):
        o, l = backend.forward(q, kb, vb, False)
        out, lse = (o.float(), l) if out is None else merge(out, lse, o, l)
    out = out.to(q.dtype)
    dq, dks, dvs = 0, [], []
    for kb, vb in zip(ks, vs):
        gq, gk, gv = backend.backward(dout, q, kb, vb, out, lse, False)
        dq, dks, dvs = dq + gq.float(), dks + [gk], dvs + [gv]
    return out, lse, dq, torch.cat(dks, 2), torch.cat(dvs, 2)


def rel(got, want) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal,blocks", [(True, 1), (False, 1), (False, 2), (False, 4)])
def test_kernels_against_fp64(device, record, dtype, heads, d, causal, blocks):
    if DRYRUN and dtype == torch.bfloat16:
        pytest.skip("the CPU kernel's bf16 path is not the CUDA one")
    backend = get_backend("auto", device)
    g = torch.Generator(device="cpu").manual_seed(0)
    s = 256 if DRYRUN else 1024
    q, k, v, dout = (torch.randn(1, n, s, d, generator=g).to(device, dtype) for n in (heads[0], heads[1], heads[1],
                                                                                       heads[0]))
    got = blocked(backend, q, k, v, dout, causal, blocks)
    want = reference(q, k, v, dout, causal)
    errs = {name: rel(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want)}
    record("T1 kernels vs fp64 (max relative error)",
           f"{backend.name} {str(dtype)[6:]} {heads[0]}/{heads[1]} heads d={d} causal={causal} blocks={blocks}",
           {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL[dtype], errs


def _fwd_bwd_seconds(fn, repeats=5) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.parametrize("heads", [(32, 32), (32, 8)], ids=["mha", "gqa"])
def test_time_against_sdpa_at_32k(device, record, heads):
    if device.type != "cuda":
        pytest.skip("timing: CUDA only")
    backend = get_backend("auto", device)
    s, d = 32768, 128
    q, k, v, dout = (torch.randn(1, n, s, d, device=device, dtype=torch.bfloat16)
                     for n in (heads[0], heads[1], heads[1], heads[0]))

    def ours():
        out, lse = backend.forward(q, k, v, True)
        backend.backward(dout, q, k, v, out, lse, True)

    def sdpa():
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=heads[0] != heads[1]).backward(dout)

    t_ours, t_sdpa = _fwd_bwd_seconds(ours), _fwd_bwd_seconds(sdpa)
    record("T1 fwd+bwd at 32K tokens, bf16, causal", f"{heads[0]}/{heads[1]} heads d=128",
           {"ours_s": round(t_ours, 4), "sdpa_s": round(t_sdpa, 4), "ratio": round(t_ours / t_sdpa, 3)})
    assert t_ours <= 1.1 * t_sdpa, (t_ours, t_sdpa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [None, 100])
def test_rectangles_against_fp64(device, record, dtype, window):
    """Documents (and a window) as rectangles (``attention/ranges.py``): bf16 through the variable-length kernel
    (``torch_attn::_varlen_attn`` and its backward from the given out and lse), fp32 one rectangle at a time; GQA
    8/2, d 128; queries of a later zigzag chunk against keys of two spans, as a ring block. Against the fp64 dense
    masked reference, rows that see no key excluded from lse (out 0 there)."""
    if DRYRUN and dtype == torch.bfloat16:
        pytest.skip("the CPU kernel's bf16 path is not the CUDA one")
    backend = get_backend("auto", device)
    s = 256 if DRYRUN else 2048
    cu = (0, s // 8, s // 8 + 1, s // 2 + 3, s - 40, s)
    q_g, k_g = [(s // 2, s)], [(0, s // 4), (s // 2, s)]
    g = torch.Generator(device="cpu").manual_seed(0)
    nq, nk = s // 2, s // 4 + s // 2
    q, dout = (torch.randn(1, 8, nq, 128, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, 2, nk, 128, generator=g).to(device, dtype) for _ in range(2))
    rects = block_rects(DocumentRanges((cu,)), window, spans(q_g), spans(k_g))
    out, lse = backend.forward_rects(q, k, v, rects)
    grads = backend.backward_rects(dout, q, k, v, out.to(dtype), lse, rects)
    qp = torch.cat([torch.arange(a, b) for a, b in q_g]).to(device)
    kp = torch.cat([torch.arange(a, b) for a, b in k_g]).to(device)
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff()).to(device)
    vis = (ids[qp][:, None] == ids[kp][None, :]) & (kp[None, :] <= qp[:, None])
    if window is not None:
        vis &= qp[:, None] - kp[None, :] < window
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    sc = (q64 @ k64.repeat_interleave(4, 1).transpose(-1, -2) / 128 ** 0.5).masked_fill(~vis, float("-inf"))
    ref_lse = torch.logsumexp(sc, -1)
    ref_out = torch.nan_to_num(torch.softmax(sc, -1)) @ v64.repeat_interleave(4, 1)
    ref_out.backward(dout.double())
    seen = torch.isfinite(ref_lse)
    errs = {"out": rel(out, ref_out), "lse": rel(lse[seen], ref_lse[seen]), "dq": rel(grads[0], q64.grad),
            "dk": rel(grads[1], k64.grad), "dv": rel(grads[2], v64.grad)}
    record("T1 rectangles vs fp64 (max relative error)", f"{str(dtype)[6:]} window={window} 8/2 heads d=128",
           {k_: f"{e:.1e}" for k_, e in errs.items()})
    assert max(errs.values()) <= TOL[dtype], errs


@pytest.mark.parametrize("name", ["cudnn", "fa3", "fa4"])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("causal,blocks", [(True, 1), (False, 1), (False, 4)])
def test_hopper_kernels_against_fp64(device, record, name, heads, causal, blocks):
    """cuDNN's and FlashAttention-3 / 4's kernels (``attention/hopper.py``: GQA native, the lse handed back as the
    ring merges it), bf16, head dim 128, against fp64; each skipped with its reason where it cannot run."""
    if device.type != "cuda":
        pytest.skip("CUDA kernels")
    why = missing(name, device)
    if why is not None:
        pytest.skip(f"{name} {why}")
    backend = Kernels(name)(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v, dout = (torch.randn(1, n, 1024, 128, generator=g).to(device, torch.bfloat16)
                     for n in (heads[0], heads[1], heads[1], heads[0]))
    errs = {n: rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), blocked(backend, q, k, v, dout,
                                                                                     causal, blocks),
                                            reference(q, k, v, dout, causal))}
    record("T1 Hopper kernels vs fp64 (max relative error)",
           f"{name} bf16 {heads[0]}/{heads[1]} heads d=128 causal={causal} blocks={blocks}",
           {k: f"{v:.1e}" for k, v in errs.items()})
    assert max(errs.values()) <= TOL[torch.bfloat16], errs
