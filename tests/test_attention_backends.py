"""Local attention kernels with lse and the online-softmax merge, against plain SDPA (fp32, forward and backward).

Tolerance: one attention call in fp32 differs from SDPA by reduction order only (~1e-6 absolute on O(1) values);
merging two key blocks by lse adds one exp/log per element (~1e-7 relative). 1e-5 is an order above both."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lc.attention.backends import MathBackend, TorchCPUBackend
from megatron_lc.attention.merge import merge

TOL = 1e-5


def qkv(nq=4, nkv=2, s=16, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, d, generator=g) for n in (nq, nkv, nkv)]


def reference(q, k, v, causal, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("backend", [TorchCPUBackend(), MathBackend()], ids=lambda b: b.name)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_backend_matches_sdpa(backend, causal, heads):
    q, k, v = qkv(*heads)
    dout = torch.randn_like(q)
    ref = reference(q, k, v, causal, dout)
    out, lse = backend.forward(q, k, v, causal)
    grads = backend.backward(dout, q, k, v, out, lse, causal)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    for got, want in zip((out, *grads), ref):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOL


@pytest.mark.parametrize("backend", [TorchCPUBackend(), MathBackend()], ids=lambda b: b.name)
def test_two_key_blocks_merged_by_lse_equal_one_call(backend):
    """What ring and FPDT do: attention over key blocks [0, 8) (causal diagonal) and, for queries of the second
    half, full attention to keys [0, 8); merged by lse; backward per block with the *merged* lse."""
    q, k, v = qkv(4, 2, s=16)
    dout = torch.randn_like(q)
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, True, dout)
    q2, k1, v1, k2, v2 = q[:, :, 8:], k[:, :, :8], v[:, :, :8], k[:, :, 8:], v[:, :, 8:]
    o_a, l_a = backend.forward(q2, k1, v1, False)
    o_b, l_b = backend.forward(q2, k2, v2, True)
    o, lse = merge(o_a, l_a, o_b, l_b)
    assert (o - ref_out[:, :, 8:]).abs().max() <= TOL
    dq_a, dk_a, dv_a = backend.backward(dout[:, :, 8:], q2, k1, v1, o, lse, False)
    dq_b, dk_b, dv_b = backend.backward(dout[:, :, 8:], q2, k2, v2, o, lse, True)
    # keys 8.. are seen only by queries 8..: their grads are complete from the second half alone
    assert (dk_b - ref_dk[:, :, 8:]).abs().max() <= TOL and (dv_b - ref_dv[:, :, 8:]).abs().max() <= TOL
    assert (dq_a + dq_b - ref_dq[:, :, 8:]).abs().max() <= TOL


def test_merge_handles_rows_with_no_keys():
    out = torch.randn(1, 1, 3, 4)
    lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])
    none = torch.full_like(lse, float("-inf"))
    o, l = merge(out, lse, torch.zeros_like(out), none)
    assert torch.isfinite(o).all() and torch.equal(l, lse)
    assert torch.allclose(o[..., 0, :], out[..., 0, :]) and (o[..., 1, :] == 0).all()
