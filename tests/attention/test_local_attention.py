"""cp 1 (``attention/local.py``): the plain forward runs SDPA only where SDPA's choice is the backend's own kernel on
k, v as they are; fp32 with GQA on CUDA -- where SDPA would run its math kernel, an s x s score matrix per head --
and every named non-default kernel go through the backend's (out, lse) pair under autograd.

Tolerance: one fp32 attention call against SDPA differs by reduction order (~1e-6 absolute on O(1) values); 1e-5."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lc.attention.backends import Kernels, MathBackend, TorchCPUBackend
from megatron_lc.attention.fused_cuda import TorchCUDABackend
from megatron_lc.attention.local import LocalCausalAttention, sdpa_is_the_kernel
from megatron_lc.rehearsal.standin import install
from tests.attention.test_attention_backends import StandInKernels

DEVICE = install()
TOL = 1e-5


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def cuda_kernels(backend) -> Kernels:
    """The model's kernels of a CUDA run, the CUDA kernel being ``backend`` (CPU stand-ins: nothing touches CUDA)."""
    k = Kernels("torch", device_type="cuda")
    k._by_device["cuda"] = backend
    return k


def test_sdpa_only_where_it_is_the_backends_kernel():
    q32, k32 = torch.empty(1, 8, 4, 2), torch.empty(1, 2, 4, 2)
    cuda = TorchCUDABackend()
    assert sdpa_is_the_kernel(TorchCPUBackend(), q32, k32)  # CPU: SDPA's CPU flash kernel takes GQA
    assert sdpa_is_the_kernel(cuda, q32.bfloat16(), k32.bfloat16())  # CUDA flash takes GQA
    assert sdpa_is_the_kernel(cuda, q32, torch.empty(1, 8, 4, 2))  # fp32 without GQA: memory-efficient
    assert not sdpa_is_the_kernel(cuda, q32, k32)  # fp32 with GQA: SDPA's math kernel on CUDA
    assert not sdpa_is_the_kernel(MathBackend(), q32, torch.empty(1, 8, 4, 2))  # a named kernel is that kernel


def test_fp32_gqa_on_cuda_runs_the_kernel_pair_and_equals_sdpa(monkeypatch):
    """8 query / 2 kv heads, fp32: forward and backward through the fused kernels' stand-ins (k, v repeated for the
    call: the stand-ins take no GQA), equal to SDPA; SDPA itself is never called."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(24, 2, n, 8, generator=g) for n in (8, 2, 2))  # [s, b, n, d]
    dout = torch.randn(24, 2, 8, 8, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in ref), is_causal=True,
                                             enable_gqa=True).permute(2, 0, 1, 3)
    out_ref.backward(dout)

    def no_sdpa(*a, **kw):
        raise AssertionError("SDPA called: on CUDA it would run its math kernel")

    monkeypatch.setattr(F, "scaled_dot_product_attention", no_sdpa)
    got = [t.clone().requires_grad_() for t in (q, k, v)]
    out = LocalCausalAttention(cuda_kernels(TorchCUDABackend(ops=StandInKernels())))(*got)
    out.backward(dout)
    assert (out - out_ref).abs().max() <= TOL
    for a, b in zip(got, ref):
        assert (a.grad - b.grad).abs().max() <= TOL


def test_on_the_stand_in_device_fp32_gqa_takes_no_math_kernel():
    """What the rehearsal found (+13.8% over the estimator): the stand-in's SDPA picks CUDA's math kernel for fp32
    with GQA. Now the memory-efficient kernel runs (k, v repeated for the call), no s x s score matrix."""
    with FakeTensorMode():
        q = torch.empty(512, 1, 8, 64, device=DEVICE)
        k, v = (torch.empty(512, 1, 2, 64, device=DEVICE) for _ in range(2))
        with Ops() as ops:
            out = LocalCausalAttention(Kernels("auto", device_type="cuda"))(q, k, v)
    assert out.shape == q.shape
    assert "_scaled_dot_product_efficient_attention" in ops.names
    assert not [n for n in ops.names if "math" in n], ops.names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_named_cudnn_kernel_is_what_the_plain_forward_runs(dtype):
    """bf16: cuDNN's op (shapes on the stand-in device); fp32: its memory-efficient fallback. SDPA's flash or math
    kernel never stands in for the kernel the config names."""
    with FakeTensorMode():
        q = torch.empty(512, 1, 8, 64, device=DEVICE, dtype=dtype)
        k, v = (torch.empty(512, 1, 2, 64, device=DEVICE, dtype=dtype) for _ in range(2))
        with Ops() as ops:
            LocalCausalAttention(Kernels("cudnn", device_type="cuda"))(q, k, v)
    want = "_scaled_dot_product_cudnn_attention" if dtype == torch.bfloat16 else \
        "_scaled_dot_product_efficient_attention"
    assert want in ops.names and "scaled_dot_product_attention" not in ops.names, ops.names
