"""model/norm.RMSNorm: nn.RMSNorm's values and gradients, with a fused kernel's saved set (input + rstd)."""
import pytest
import torch

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
