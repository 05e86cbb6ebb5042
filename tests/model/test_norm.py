"""model/norm.RMSNorm: nn.RMSNorm's values and gradients, with a fused kernel's saved set (input + rstd)."""
import pytest
import torch

from megatron_lc.model import norm as norm_mod
from megatron_lc.model.norm import RMSNorm


@pytest.mark.parametrize("shape", [(7, 3, 64), (5, 64)])
def test_matches_nn_rmsnorm_forward_and_backward(shape):
    torch.manual_seed(0)
    ref = torch.nn.RMSNorm(64, eps=1e-5)
    ref.weight.data.uniform_(0.5, 1.5)
    ours = RMSNorm(64, eps=1e-5)
    ours.weight.data.copy_(ref.weight.data)
    x1 = (3 * torch.randn(*shape)).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ref(x1), ours(x2)
    g = torch.randn_like(y1)
    y1.backward(g)
    y2.backward(g)
    # fp32, same formula; only the reduction order of the backward's row dot product and the weight-gradient sum
    # differ (~1e-7 relative): 1e-6 leaves an order of magnitude
    assert torch.equal(y1, y2)
    assert torch.allclose(x1.grad, x2.grad, rtol=1e-6, atol=1e-6 * x1.grad.abs().max().item())
    assert torch.allclose(ref.weight.grad, ours.weight.grad, rtol=1e-6, atol=1e-6 * ref.weight.grad.abs().max().item())


def test_saves_only_input_rstd_and_weight():
    norm = RMSNorm(64, eps=1e-5)
    x = torch.randn(32, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        norm(x)
    assert sorted(tuple(t.shape) for t in saved) == [(32, 1), (32, 64), (64,)]
    assert any(t is x for t in saved)  # the input itself, not a copy


def test_backward_runs_in_slices_with_bounded_temporaries(monkeypatch):
    """The CPU backward holds, beside the input grad, temporaries of one slice of rows (torch's fused CUDA kernel
    holds none the size of x): at Llama3-8B x 1M on 8 ranks with an fp32 residual, 2 x 2 GiB at every norm's
    backward otherwise (the rehearsal counts this twin). Sliced or not, dx is the same bit for bit (each row's
    arithmetic is), dweight the same sums in another order."""
    import megatron_lc.model.norm as norm_module
    from megatron_lc.planning.capture.tracker import DispatchTracer

    torch.manual_seed(0)
    x = torch.randn(64, 2, 64)
    g = torch.randn(64, 2, 64)
    grads, extra = {}, {}
    for rows in (64, 4):  # one slice; 16 slices of 4 rows
        monkeypatch.setattr(norm_module, "RMS_NORM_SLICE_ELEMS", rows * 2 * 64)
        norm = RMSNorm(64, eps=1e-5)
        xi = x.clone().requires_grad_()
        with DispatchTracer() as tracker:
            y = norm(xi)
            start, live = len(tracker.events), tracker.live_bytes()
            start_live = live
            y.backward(g)
            peak = live
            for e in tracker.events[start:]:
                live += e.size if e.op == "malloc" else -e.size
                peak = max(peak, live)
        grads[rows] = (xi.grad, norm.weight.grad)
        extra[rows] = peak - start_live
    full = x.numel() * 4  # fp32: dx, x·rstd, the grad times it (and their product), each this size unsliced
    # above what existed: dx, plus x·rstd and the grad times it for one slice (1/16 of the rows), plus dweight and
    # rstd-sized odds (1 KiB)
    assert extra[64] >= 3 * full and extra[4] <= full + 3 * full // 16 + 1024, extra
    assert torch.equal(grads[64][0], grads[4][0])
    # fp32; the 16 partial sums of dweight add in another order than one sum over 128 rows: ~1e-7 relative
    assert torch.allclose(grads[64][1], grads[4][1], rtol=1e-6, atol=1e-6 * grads[64][1].abs().max().item())


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_branch_calls_the_fused_kernel_in_the_inputs_dtype(monkeypatch, x_dtype):
    """On CUDA the norm is torch's ``F.rms_norm``, whose fused kernel takes one dtype: under FSDP2 the weight comes
    gathered in bf16 beside an fp32 residual (else a composite with an fp32 copy of x), and CUDA autocast's fp32
    rule for rms_norm would copy a bf16 residual to fp32. The call gets the weight in x's dtype, outside autocast,
    and its output is the CPU twin's. (The branch is chosen by ``uses_fused_kernel``; the CPU plays CUDA here.)"""
    calls, rms_norm = [], torch.nn.functional.rms_norm

    def spy(x, shape, weight, eps):
        calls.append((x.dtype, weight.dtype, torch.is_autocast_enabled("cpu")))
        return rms_norm(x, shape, weight, eps)

    norm = RMSNorm(64, eps=1e-5).to(torch.bfloat16)  # FSDP2's gathered weight
    x = torch.randn(8, 64).to(x_dtype)
    twin = norm(x)
    monkeypatch.setattr(norm_mod, "uses_fused_kernel", lambda t: True)
    monkeypatch.setattr(norm_mod.F, "rms_norm", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = norm(x)
    assert calls == [(x_dtype, x_dtype, False)]
    assert fused.dtype == twin.dtype == x_dtype
    torch.testing.assert_close(fused, twin, rtol=1e-2 if x_dtype == torch.bfloat16 else 1e-6, atol=1e-2)
