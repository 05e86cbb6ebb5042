"""The rehearsal's stand-in accelerator (megatron_lc/rehearsal/standin.py): a device of its own, distinct from the host,
with CUDA's autocast rules; an op that mixes host and device tensors raises where CUDA would (mix_check.py) -- the
save's finite check was such an op."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.memory.forward_state import as_in_forward, autocast_state
from megatron_lc.rehearsal import standin_autocast
from megatron_lc.rehearsal.mix_check import DeviceMixCheck, DeviceMixError
from megatron_lc.rehearsal.standin import install
from megatron_lc.rehearsal.standin_autocast import policies
from megatron_lc.training.checkpointing.save import first_non_finite

DEVICE = install()  # before any backward of this process (the autograd engine counts devices once)
F = torch.nn.functional


def test_the_stand_in_is_a_device_of_its_own_and_fake_tensors_keep_it():
    with FakeTensorMode():
        x = torch.empty(4, 8, device=DEVICE)
        assert x.device == DEVICE and (x @ x.t()).device == DEVICE and x.to("cpu").device.type == "cpu"
        with pytest.raises(RuntimeError, match="found at least two devices"):
            x + torch.empty(8)  # as CUDA: "Expected all tensors to be on the same device"


def test_its_autocast_lists_are_the_ones_pytorch_registers_for_cuda():
    assert set(policies()) == set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))


def _autocast_cases(d) -> dict:
    a, w, v = torch.empty(4, 8, device=d), torch.empty(8, 8, device=d), torch.empty(8, device=d)
    b, q = a.bfloat16(), torch.empty(1, 2, 16, 64, device=d)
    labels = torch.zeros(4, dtype=torch.long, device=d)
    return {"mm": lambda: a @ w, "linear": lambda: F.linear(a, w), "baddbmm": lambda: torch.baddbmm(
        a.unsqueeze(0), a.unsqueeze(0), w.unsqueeze(0)), "sum": lambda: b.sum(), "sum dim": lambda: b.sum(-1),
        "softmax": lambda: b.softmax(-1), "log_softmax": lambda: b.log_softmax(-1), "exp": lambda: b.exp(),
        "rsqrt": lambda: b.rsqrt(), "pow": lambda: b.pow(2), "mean": lambda: b.mean(), "add": lambda: b + a,
        "addcmul bf16": lambda: torch.addcmul(b, b, b), "addcmul mixed": lambda: torch.addcmul(a, b, b),
        "rms_norm mixed": lambda: F.rms_norm(a, (8,), v.bfloat16()), "cross_entropy": lambda: F.cross_entropy(
            b, labels), "norm": lambda: b.norm(), "cumsum": lambda: b.cumsum(0), "silu": lambda: F.silu(a),
        "flash attention": lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True)[0]}


def test_autocast_on_the_stand_in_gives_the_dtypes_cuda_autocast_gives():
    """CUDA's autocast kernels run on fake ``cuda`` tensors that need no grad (no device guard is asked), so the
    stand-in's outputs are compared with CUDA's own, op by op."""
    with FakeTensorMode():
        torch.set_autocast_dtype("cuda", torch.bfloat16)
        torch.set_autocast_enabled("cuda", True)  # (torch.autocast("cuda") turns itself off without CUDA)
        try:
            cuda = {k: f().dtype for k, f in _autocast_cases("cuda").items()}
        finally:
            torch.set_autocast_enabled("cuda", False)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            ours = {k: f().dtype for k, f in _autocast_cases(DEVICE).items()}
    assert ours == cuda
    assert cuda["mm"] == torch.bfloat16 and cuda["sum"] == torch.float32  # (both policies seen)


def test_a_weights_cast_is_cached_until_autocast_exits():
    with FakeTensorMode():
        w = torch.nn.Parameter(torch.empty(8, 8, device=DEVICE))
        x = torch.empty(4, 8, device=DEVICE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            x @ w
            x @ w
            assert len(standin_autocast._CACHE) == 1
        assert not standin_autocast._CACHE


def _mixed(op):
    with FakeTensorMode():
        d, host = torch.empty(4, device=DEVICE), torch.empty(4)
        with DeviceMixCheck(DEVICE) as check:
            try:
                op(d, host)
                return check.violations
            except DeviceMixError:
                return check.violations


@pytest.mark.parametrize("op", [
    lambda d, h: d * h[0],  # a 0-dim host tensor in an elementwise op (TensorIterator)
    lambda d, h: d.copy_(h),
    lambda d, h: h.copy_(d),
    lambda d, h: d.to("cpu") + h,
    lambda d, h: d[torch.tensor([0, 1])],  # host indices
    lambda d, h: torch._foreach_mul_([d], h[0]),
])
def test_what_cuda_accepts_passes(op):
    assert _mixed(op) == []


@pytest.mark.parametrize("op, name", [
    (lambda d, h: torch.stack([d.sum(), h[0]]), "aten.stack.default"),  # fake tensors let this one through
    (lambda d, h: d + h, "aten.add.Tensor"),
    (lambda d, h: h[0].add_(d[0]), "aten.add_.Tensor"),  # a host scalar written with device data
    (lambda d, h: torch.dot(d, h), "aten.dot.default"),
])
def test_what_cuda_refuses_raises_and_is_reported_with_its_site(op, name):
    got = _mixed(op)
    assert [v["op"] for v in got] == [name], got
    assert got[0]["site"].startswith("tests/rehearsal/test_standin.py:"), got


def test_the_save_finite_check_runs_with_adamw_step_counts_on_the_host():
    """AdamW keeps its ``step`` counts on the host beside the device's weights and moments: the save's finite check
    must not stack them together (on CUDA: "Expected all tensors to be on the same device", at the first save)."""
    with FakeTensorMode():
        state = {"model/w": torch.empty(8, 8, device=DEVICE), "optim/w/exp_avg": torch.empty(8, 8, device=DEVICE),
                 "optim/w/step": torch.zeros(())}
        with DeviceMixCheck(DEVICE) as check:
            assert first_non_finite(state) is None  # (fake tensors: no value to find non-finite)
    assert check.violations == []
    real = {"w": torch.ones(3), "step": torch.tensor(2.0), "bad": torch.tensor([1.0, float("inf")])}
    assert first_non_finite(real) == "bad"


def test_a_re_run_in_backward_re_enters_the_stand_ins_autocast():
    """Memo's and the host checkpoints' re-runs re-enter the forward's autocast (``memory/forward_state.py``); on the
    stand-in it was left out, so the re-run computed in fp32 and ring attention sent fp32 k/v in backward (4/3 of
    the backward's bytes at Llama3-8B x 1M)."""
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        state = autocast_state()
    assert state == [(DEVICE.type, torch.bfloat16)]
    with FakeTensorMode():
        x = torch.empty(4, 8, device=DEVICE)
        with as_in_forward(state, grad=True):
            assert (x @ x.t()).dtype == torch.bfloat16
