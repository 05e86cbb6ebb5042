"""Local attention kernels with lse and the online-softmax merge, against plain SDPA (fp32, forward and backward).

Tolerance: one attention call in fp32 differs from SDPA by reduction order only (~1e-6 absolute on O(1) values);
merging two key blocks by lse adds one exp/log per element (~1e-7 relative). 1e-5 is an order above both."""
import pytest
import torch
import torch.nn.functional as F

from megatron_lc.attention.backends import MathBackend, TorchCPUBackend
from megatron_lc.attention.fused_cuda import TorchCUDABackend
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


# ---- PyTorch's fused CUDA kernels (fused_cuda.TorchCUDABackend), wrapping tested on CPU ---------------------------
class StandInKernels:
    """CPU stand-ins with the signatures and constraints of aten's CUDA kernels, computed by ``MathBackend``: the
    flash pair takes fewer kv heads (``mha_fwd`` / ``mha_bwd``: "Number of heads in key/value must divide number of
    heads in query"), the memory-efficient pair does not (``_efficient_attention_backward``: ``query.size(2) ==
    key.size(2)``) and pads its lse to a multiple of 32 (NaN in the padding, which must never be read); no bias
    (masks are never dense); dropout 0, so the RNG arguments are never read (flash_api.cpp: ``if (is_dropout)``).
    ``seen``: (op, k, dout) of each backward, for the no-repeat / no-copy checks."""

    math = MathBackend()

    def __init__(self):
        self.seen = []

    @staticmethod
    def _heads(q, k):
        assert q.shape[1] == k.shape[1], "the memory-efficient kernel takes no GQA"

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, return_debug_mask, scale=None):
        assert q.shape[1] % k.shape[1] == 0 and dropout_p == 0.0
        out, lse = self.math.forward(q, k, v, is_causal, scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                     dropout_p, is_causal, seed, offset, scale=None):
        assert q.shape[1] % k.shape[1] == 0 and dropout_p == 0.0
        assert lse.shape == q.shape[:3] and max_q == q.shape[2] and max_k == k.shape[2]
        self.seen.append(("flash_backward", k, dout))
        return self.math.backward(dout, q, k, v, out, lse, is_causal, scale)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, dropout_p, is_causal, scale=None):
        self._heads(q, k)
        assert compute_lse and bias is None
        out, lse = self.math.forward(q, k, v, is_causal, scale)
        sq = q.shape[2]
        padded = torch.full((*lse.shape[:2], (sq + 31) // 32 * 32), float("nan"))
        padded[..., :sq] = lse
        return out, padded, None, None

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset,
                                                         dropout_p, grad_input_mask, is_causal=False, scale=None):
        self._heads(q, k)
        sq = q.shape[2]
        assert lse.shape[-1] == (sq + 31) // 32 * 32 and bias is None
        self.seen.append(("efficient_backward", k, dout))
        dq, dk, dv = self.math.backward(dout, q, k, v, out, lse[..., :sq], is_causal, scale)
        return dq, dk, dv, None


class FlashPathOnCPU(TorchCUDABackend):
    """The bf16/fp16 branch (aten's flash kernel) exercised in fp32."""

    @staticmethod
    def _uses_flash(q):
        return True


CUDA_WRAPPERS = [TorchCUDABackend(ops=StandInKernels()), FlashPathOnCPU(ops=StandInKernels())]


@pytest.mark.parametrize("backend", CUDA_WRAPPERS, ids=["efficient", "flash"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_fused_cuda_wrapping_matches_sdpa(backend, causal, heads):
    """GQA repeated for the kernels and summed back, the padded lse sliced and padded again."""
    test_backend_matches_sdpa(backend, causal, heads)


@pytest.mark.parametrize("backend", CUDA_WRAPPERS, ids=["efficient", "flash"])
def test_fused_cuda_wrapping_merges_blocks(backend):
    test_two_key_blocks_merged_by_lse_equal_one_call(backend)


def test_the_flash_kernel_gets_the_kv_heads_and_dout_as_they_are():
    """8 query and 2 kv heads as ``[b, n, s, d]`` views of ``[s, b, n, d]`` tensors (``core.to_bnsd``): the flash
    backward gets k and dout themselves -- no repeat to the query heads (the kernel sums dk, dv over each group
    itself), no ``dout.contiguous()`` (the kernel makes the ``[b, s, n, d]`` transpose contiguous, a no-op for this
    layout at batch 1, so a copy here would be a second one); the memory-efficient kernel still gets k repeated."""
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(16, 1, n, 8, generator=g).permute(1, 2, 0, 3) for n in (8, 2, 2, 8))
    flash, efficient = FlashPathOnCPU(ops=StandInKernels()), TorchCUDABackend(ops=StandInKernels())
    for backend in (flash, efficient):
        out, lse = backend.forward(q, k, v, True)
        ref = reference(q, k, v, True, dout)
        grads = backend.backward(dout, q, k, v, out, lse, True)
        for got, want in zip((out, *grads), ref):
            assert (got - want).abs().max() <= TOL
    (_, k_flash, dout_flash), = flash.ops.seen
    assert k_flash is k and dout_flash is dout
    (_, k_eff, _), = efficient.ops.seen
    assert k_eff.shape[1] == 8  # repeated for the kernel that takes no GQA


def test_the_rng_placeholders_have_the_forwards_forms():
    """Dropout 0: no backward reads its RNG arguments (flash_api.cpp ``mha_bwd``: ``if (is_dropout) {
    params.rng_state = philox_seed.data_ptr<uint64_t>(); }``); they are passed in the forms the forwards return --
    flash's ``[2]`` uint64 state and 0-dim uint64, the memory-efficient kernel's 0-dim int64 seed and offset."""
    from megatron_lc.attention.fused_cuda import rng_placeholders

    q = torch.empty(1, 2, 4, 8)
    (state, unused), (seed, offset) = rng_placeholders(q), rng_placeholders(q, flash=False)
    assert state.shape == (2,) and state.dtype == torch.uint64 and unused.shape == () and unused.dtype == torch.uint64
    assert seed.shape == offset.shape == () and seed.dtype == offset.dtype == torch.int64


def test_backend_choice_per_device(monkeypatch):
    """auto on CUDA without a measured table: PyTorch's fused kernels, even with flash-attn installed (never the
    package that happens to import: ``kernel_table.py``); torch: the device's fused kernel; math only when named
    (device mocked: nothing touches CUDA)."""
    import megatron_lc.attention.backends as b

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert isinstance(b.get_backend("auto", cuda), TorchCUDABackend)  # flash-attn is not installed here
    assert isinstance(b.get_backend("torch", cuda), TorchCUDABackend)
    assert isinstance(b.get_backend("torch", cpu), TorchCPUBackend) and isinstance(b.get_backend("auto", cpu),
                                                                                    TorchCPUBackend)
    assert isinstance(b.get_backend("math", cuda), MathBackend)

    class FakeFlash(b.FlashAttnBackend):
        def __init__(self, masked=None):
            self.masked = masked

    monkeypatch.setattr(b, "FlashAttnBackend", FakeFlash)
    assert type(b.get_backend("auto", cuda)) is TorchCUDABackend  # installed, but unmeasured: not chosen
    assert b.get_backend("flash", cuda).masked is None
