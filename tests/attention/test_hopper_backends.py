"""cuDNN's fused attention and FlashAttention-3 / 4 through PyTorch's registry (``attention/hopper.py``), and how
``parallel.attention_backend`` chooses (``attention/backends.py``, ``attention/kernel_table.py``).

The calls are built against CPU stand-ins with the aten ops' signatures, computed by ``MathBackend``; each stand-in
checks what the real kernel needs and what these adapters promise: k, v reach the kernel as the very tensors the
core passed (fewer kv heads, its strides: no repeat, no layout copy), the lse in the kernel's own layout (cuDNN's
``[b, n, s, 1]``, a view of the merged ``[b, n, s]``), no bias. Tolerance: as test_attention_backends.py (one fp32
call differs from SDPA by reduction order, ~1e-6; 1e-5)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import megatron_lc.attention.backends as backends
from megatron_lc.attention.backends import Kernels, MathBackend, TorchCPUBackend
from megatron_lc.attention.fused_cuda import TorchCUDABackend
from megatron_lc.attention.hopper import CudnnBackend, RegisteredFlashBackend, cudnn_head_dim_refusal, dense
from megatron_lc.attention.kernel_table import parse_table
from megatron_lc.config import ConfigError, load_config, resolve_layout
from tests.attention import test_attention_backends as same_as_sdpa, test_ranges as same_as_masked
from tests.attention.test_attention_backends import StandInKernels
from tests.attention.test_ranges import StandInVarlen


class NativeGQAStandIns:
    """CPU stand-ins of ``aten._scaled_dot_product_cudnn_attention`` (+ backward) and of the flash pair as the
    registry routes it (fewer kv heads taken). ``seen``: (op, k, v) of every call, for the no-copy checks."""

    math = MathBackend()

    def __init__(self):
        self.seen = []

    def _scaled_dot_product_cudnn_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p, is_causal,
                                            return_debug_mask, scale=None):
        assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        self.seen.append(("cudnn", k, v))
        out, lse = self.math.forward(q, k, v, is_causal, scale)
        out = dense(torch.empty_like(q)).copy_(out)  # MHA.cpp alloc_with_matching_layout: dense, in q's dim order
        seed = torch.zeros((), dtype=torch.int64)
        return out, lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], seed, seed, None

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, seed, offset, attn_bias, cum_q,
                                                     cum_k, max_q, max_k, dropout_p, is_causal, scale=None):
        assert lse.shape == (*q.shape[:3], 1) and attn_bias is None and cum_q is None and cum_k is None
        assert (max_q, max_k) == (q.shape[2], k.shape[2]) and dropout_p == 0.0
        # CUDA's constraints (aten/src/ATen/native/cudnn/MHA.cpp): the graph's dQ / dK / dV have q's / k's / v's
        # strides and are checked against ``empty_like`` of them (dense: a gapped view's strides differ); O and dO
        # have q's layout
        for t in (q, k, v):
            assert torch.empty_like(t).stride() == t.stride(), "check_tensor_matches_graph(DQ / DK / DV) fails"
        assert out.stride() == q.stride() and dout.stride() == q.stride(), "check_tensor_matches_graph(O / DO)"
        self.seen.append(("cudnn_backward_inputs", q, out, dout))
        self.seen.append(("cudnn_backward", k, v, lse))
        return self.math.backward(dout, q, k, v, out, lse[..., 0], is_causal, scale)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p, is_causal, return_debug_mask, scale=None):
        self.seen.append(("flash", k, v))
        out, lse = self.math.forward(q, k, v, is_causal, scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k,
                                                     dropout_p, is_causal, seed, offset, scale=None):
        assert lse.shape == q.shape[:3] and (max_q, max_k) == (q.shape[2], k.shape[2])
        self.seen.append(("flash_backward", k, v, lse))
        return self.math.backward(dout, q, k, v, out, lse, is_causal, scale)


class LowPrecisionPath:
    """The bf16 / fp16 branch (the backend's own dense kernel, the variable-length one for rectangles) in fp32."""

    @staticmethod
    def _uses_flash(q):
        return True


class CudnnOnCPU(LowPrecisionPath, CudnnBackend):
    pass


class RegisteredOnCPU(LowPrecisionPath, RegisteredFlashBackend):
    pass


def adapters():
    return [CudnnOnCPU(ops=NativeGQAStandIns(), varlen=StandInVarlen()),
            RegisteredOnCPU("fa3", ops=NativeGQAStandIns(), varlen=StandInVarlen(), activate=False),
            RegisteredOnCPU("fa4", ops=NativeGQAStandIns(), varlen=StandInVarlen(), activate=False)]


IDS = ["cudnn", "fa3", "fa4"]


@pytest.mark.parametrize("backend", adapters(), ids=IDS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_hopper_calls_match_sdpa(backend, causal, heads):
    same_as_sdpa.test_backend_matches_sdpa(backend, causal, heads)


@pytest.mark.parametrize("backend", adapters(), ids=IDS)
def test_hopper_blocks_merged_by_lse_with_the_backward_from_the_merged_lse(backend):
    same_as_sdpa.test_two_key_blocks_merged_by_lse_equal_one_call(backend)


@pytest.mark.parametrize("make", [0, 1], ids=["cudnn", "fa3"])
def test_gqa_reaches_the_kernel_without_repeat_or_layout_copy(make):
    """k, v as ``[b, n, s, d]`` views of the cores' ``[s, b, n, d]`` tensors (``core.to_bnsd``), 8 query heads and 2
    kv heads: the kernel gets those very tensors, forward and backward; the backward's lse is the given one."""
    backend = adapters()[make]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(16, 1, n, 8, generator=g).permute(1, 2, 0, 3) for n in (8, 2, 2))
    out, lse = backend.forward(q, k, v, True)
    backend.backward(torch.randn_like(out), q, k, v, out, lse, True)
    (_, k_f, v_f), (_, k_b, v_b, lse_b) = [e for e in backend.ops.seen if e[0] != "cudnn_backward_inputs"]
    for got in (k_f, k_b):
        assert got is k and got.shape[1] == 2  # no repeat_interleave, no .contiguous()
    assert v_f is v and v_b is v
    assert lse_b.data_ptr() == lse.data_ptr()  # the kernel's layout as a view of the lse handed in


def test_cudnn_lse_comes_back_as_b_n_s():
    backend = adapters()[0]
    q, k, v = (torch.randn(2, n, 16, 8) for n in (4, 2, 2))
    out, lse = backend.forward(q, k, v, False)
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32


@pytest.mark.parametrize("backend", adapters()[:2], ids=IDS[:2])
@pytest.mark.parametrize("window", [None, 3])
def test_documents_and_windows_through_the_varlen_kernel(backend, window):
    """Rectangles (no bias: ``ranges.py``) through the inherited variable-length packing, GQA native."""
    same_as_masked.test_rectangles_equal_the_dense_masked_attention(backend, window, (4, 1))


def test_fp32_falls_back_to_the_memory_efficient_kernel_with_repeat():
    """No low-precision kernel takes fp32: the ``torch`` backend's memory-efficient path (k, v repeated)."""
    class Both(StandInKernels, NativeGQAStandIns):
        pass

    ops = Both()
    ops.seen = []
    same_as_sdpa.test_backend_matches_sdpa(CudnnBackend(ops=ops), True, (4, 2))
    assert not [e for e in ops.seen if e[0].startswith("cudnn")]  # cuDNN's op never called in fp32


def test_cudnn_backward_gets_dense_q_k_v_and_out_dout_in_q_layout():
    """q, k, v as the attention block makes them: gapped views of the fused QKV output ``[s, b, (8 + 2 + 2) * 8]``
    (``model/attention.py``), as ``[b, n, s, d]`` views. cuDNN's backward checks dQ / dK / dV -- ``empty_like`` of
    q, k, v, so dense -- against a graph built with q's, k's, v's strides, and O / dO against q's layout (the
    stand-in asserts both, as MHA.cpp's ``check_tensor_matches_graph``): the adapter hands it dense copies of the
    gapped views and out, dout in q's layout; the grads equal SDPA's."""
    g = torch.Generator().manual_seed(4)
    fused = torch.randn(16, 1, 12 * 8, generator=g)
    q, k, v = (t.view(16, 1, -1, 8).permute(1, 2, 0, 3) for t in fused.split([64, 16, 16], dim=-1))
    assert torch.empty_like(v).stride() != v.stride()  # gapped: what made cuDNN's backward fail
    backend = adapters()[0]
    dout = torch.randn(16, 1, 8, 8, generator=g).permute(1, 2, 0, 3)  # the cores' view of an [s, b, n, d] grad
    out, lse = backend.forward(q, k, v, True)
    grads = backend.backward(dout, q, k, v, out, lse, True)
    for got, want in zip((out, *grads), same_as_sdpa.reference(q, k, v, True, dout)):
        assert (got - want).abs().max() <= same_as_sdpa.TOL
    (_, q_b, out_b, dout_b), = [e for e in backend.ops.seen if e[0] == "cudnn_backward_inputs"]
    assert q_b is not q and out_b is out and dout_b is dout  # q copied dense in its own dim order; out, dout not


def test_cudnn_head_dims_above_128_as_sdpa_checks_them():
    """``check_cudnn_tensor_shapes`` (sdp_utils.cpp): 128 at most, 256 with cuDNN >= 9.10 on compute capability
    9.0, multiples of 8; a direct op call skips that check, so the adapter mirrors it: named, one ConfigError line;
    under auto, PyTorch's flash kernel for that head dim."""
    assert cudnn_head_dim_refusal(128, (8, 0), 8900) is None and cudnn_head_dim_refusal(256, (9, 0), 91002) is None
    assert cudnn_head_dim_refusal(256, None, None) is None  # no GPU (a rehearsal): nothing known, nothing refused
    assert "9.10" in cudnn_head_dim_refusal(256, (9, 0), 90800) and "9.10" in cudnn_head_dim_refusal(256, (10, 0),
                                                                                                    91002)
    assert "multiple of 8" in cudnn_head_dim_refusal(100, (9, 0), 91002)
    named, under_auto = (CudnnOnCPU(ops=NativeGQAStandIns(), named=n, device=torch.device("cuda")) for n in (True,
                                                                                                          False))
    for b in (named, under_auto):
        b._refusal[16] = cudnn_head_dim_refusal(256, (9, 0), 90800)  # this GPU: cuDNN 9.8 (head dim 16 plays 256)
    q, k, v = (torch.randn(1, n, 8, 16) for n in (4, 2, 2))
    with pytest.raises(ConfigError) as e:
        named.forward(q, k, v, True)
    assert str(e.value).startswith("parallel.attention_backend cudnn: head dim 256 needs cuDNN >= 9.10") and \
        "\n" not in str(e.value)
    under_auto.ops = Both = type("Both", (StandInKernels, NativeGQAStandIns), {})()
    out, lse = under_auto.forward(q, k, v, True)
    assert Both.seen == [] and out.shape == q.shape  # the flash stand-in ran, cuDNN's op never did


@pytest.mark.parametrize("name", ["cudnn", "fa3"])
def test_shapes_under_fake_tensors(name):
    """The rehearsal runs the real aten ops' shape functions: bf16, 32 query / 8 kv heads, causal and a block."""
    with FakeTensorMode():
        backend = CudnnBackend() if name == "cudnn" else RegisteredFlashBackend(name, activate=False)
        q = torch.empty(256, 1, 32, 64, dtype=torch.bfloat16).permute(1, 2, 0, 3)
        k, v = (torch.empty(256, 1, 8, 64, dtype=torch.bfloat16).permute(1, 2, 0, 3) for _ in range(2))
        for causal in (True, False):
            out, lse = backend.forward(q, k, v, causal)
            dq, dk, dv = backend.backward(torch.empty_like(out), q, k, v, out, lse, causal)
            assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
            assert dk.shape == k.shape and dv.shape == v.shape and dq.shape == q.shape
            assert out.stride() == q.stride()  # q's layout: to_sbnd makes no copy


# ---- the choice ------------------------------------------------------------------------------------------------------
def test_a_named_backend_that_cannot_run_is_one_line():
    """fa3 / fa4 without their packages, flash / te without theirs: one ConfigError line naming what is missing."""
    for name, word in (("fa3", "flash_attn_interface"), ("fa4", "flash-attn-4"), ("flash", "flash_attn"),
                       ("te", "transformer_engine")):
        with pytest.raises(ConfigError) as e:
            Kernels(name)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"parallel.attention_backend {name} needs") and word in msg, msg
    assert isinstance(Kernels("cudnn")(torch.device("cuda")), CudnnBackend)  # stock PyTorch: the op is there


def test_a_rehearsal_builds_the_registered_kernels_without_their_packages():
    k = Kernels("fa3", device_type="cuda")
    backend = k(torch.device("cpu"))
    assert isinstance(backend, RegisteredFlashBackend) and backend.name == "fa3"
    assert torch.nn.attention.current_flash_attention_impl() is None  # nothing activated


TABLE = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "date": "2026-12-01", "versions": {"torch": "2.13.0"},
         "backends": {"torch": {"ring_block": {"fwd": 0.35, "bwd": 0.30}, "ring_diagonal": {"fwd": 0.33, "bwd": 0.28}},
                      "cudnn": {"ring_block": {"fwd": 0.60, "bwd": 0.45}, "ring_diagonal": {"fwd": 0.50, "bwd": 0.40}},
                      "fa3": {"ring_block": {"fwd": 0.70, "bwd": 0.55}, "ring_diagonal": {"fwd": 0.62, "bwd": 0.50}}}}


@pytest.fixture
def on_a_gpu(monkeypatch):
    """A CUDA device as ``auto_choice`` asks about it (nothing touches CUDA), the table given by the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    backends.auto_choice.cache_clear()
    yield monkeypatch
    backends.auto_choice.cache_clear()


def test_auto_takes_the_fastest_measured_backend_it_can_run(on_a_gpu):
    on_a_gpu.setattr(backends, "table_for_gpu", lambda name, cap: parse_table(TABLE, "test"))
    runnable = {"torch", "cudnn"}  # fa3, the fastest measured, is not installed: skipped without a word
    on_a_gpu.setattr(backends, "missing", lambda name, dev=None: None if name in runnable else "not installed")
    assert backends.auto_choice("cuda:0") == "cudnn"
    backends.auto_choice.cache_clear()
    runnable.add("fa3")
    assert backends.auto_choice("cuda:0") == "fa3"


def test_auto_without_a_table_is_torch_whatever_imports(on_a_gpu):
    on_a_gpu.setattr(backends, "table_for_gpu", lambda name, cap: None)
    on_a_gpu.setattr(backends, "missing", lambda name, dev=None: None)  # every package installed
    assert backends.auto_choice("cuda:0") == "torch"
    assert isinstance(backends.get_backend("auto", torch.device("cuda")), TorchCUDABackend)  # a rehearsal: torch
    assert isinstance(backends.get_backend("auto", torch.device("cpu")), TorchCPUBackend)


def test_table_fastest_weighs_the_layouts_call_kinds():
    t = parse_table(TABLE, "test")
    assert t.fastest(["torch", "cudnn"]) == "cudnn"
    fwd, bwd = t.efficiency("cudnn", {"ring_block": 7.0, "ring_diagonal": 1.0})
    assert abs(fwd - 8 / (7 / 0.60 + 1 / 0.50)) < 1e-12 and 0.40 < bwd < 0.45  # time-weighted
    assert t.efficiency("cudnn", {"ulysses": 1.0}) is None  # not measured for that call
    with pytest.raises(ConfigError, match="unknown call kind 'ring'"):
        parse_table({**TABLE, "backends": {"torch": {"ring": {"fwd": 0.3, "bwd": 0.3}}}}, "x.yaml")


@pytest.mark.parametrize("name", ["cudnn", "fa3", "fa4"])
def test_a_cuda_only_backend_on_a_cpu_run_is_refused_in_one_line(name):
    with pytest.raises(ConfigError) as e:
        resolve_layout(load_config(None, ["data.mock_data=true", "train.device=cpu",
                                          f"parallel.attention_backend={name}"]), 1)
    assert str(e.value).startswith(f"parallel.attention_backend={name} with train.device=cpu")
    with pytest.raises(ConfigError, match="runs on CUDA only"):  # train.device auto on a machine without a GPU
        Kernels("cudnn")(torch.device("cpu"))
