"""What the GPU path changes that the CPU can check. Under autocast a technique keeps what the plain path keeps --
checked with CPU bf16 autocast, whose dtype rules are CUDA autocast's: MsT saves its input in bf16 (as the unchunked
linears do), FPDT's attention output (and so its gradient) is bf16, Memo calibrates under the training autocast
(bf16 activations: smaller rounding buffers), the plan's trace runs the forward under it and the backward outside.
FPDT and Memo share the device's two copy streams; a CUDA trace leaves host storages out."""
import torch

from megatron_lc.compose import Calibration
from megatron_lc.config import Execution, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.memory.mst.mlp_function import mini_sequence_mlp
from tests.support.parity import batch_for, build, small_config


def bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def saved_dtypes(fn):
    """dtypes of the float tensors autograd saves while ``fn`` runs, parameters left out."""
    seen = []

    def pack(t):
        if t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            seen.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen


def test_mst_mlp_saves_its_input_in_the_compute_dtype():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=g, requires_grad=True)
    w1 = torch.nn.Parameter(torch.randn(64, 16, generator=g))
    w2 = torch.nn.Parameter(torch.randn(16, 32, generator=g))
    with bf16():
        out, seen = saved_dtypes(lambda: mini_sequence_mlp(x, w1, None, w2, "swiglu", 16))
    assert out.dtype == torch.bfloat16
    assert ((64, 16), torch.bfloat16) in seen and ((64, 16), torch.float32) not in seen, seen
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w1.grad.dtype == torch.float32


def test_fpdt_block_output_is_in_the_compute_dtype():
    cfg = small_config(["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8", "memory.fpdt_offload=false"])
    model, _ = build(cfg)
    att = model.layers[0].self_attention
    seen = []
    att.linear_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    b = batch_for(cfg)
    with bf16():
        loss = model(b["tokens"], b["position_ids"], b["labels"]).float().mean()
    loss.backward()
    assert seen and set(seen) == {torch.bfloat16}, seen


def test_memo_calibrates_under_the_training_autocast():
    cfg = small_config(["memory.activation_offload=memo", "memory.offload_fraction=0.25", "data.seq_length=64"])
    model, ctx = build(cfg)  # calibrated without autocast (fp32 training)
    fp32 = ctx.memo.buffers[0].capacity
    cpu_bf16 = Execution(torch.device("cpu"), torch.bfloat16)  # CPU autocast stands for the GPU's
    ctx.memo.calibrate(model, Calibration(cfg, resolve_layout(cfg, 1), Topology(), cpu_bf16, batch=None))
    ctx.memo.allocate()
    assert ctx.memo.buffers[0].capacity < 0.8 * fp32, (ctx.memo.buffers[0].capacity, fp32)


def test_one_offload_and_one_prefetch_stream_per_device():
    """FPDT and Memo copy on the device's two shared streams (CUDA's pool would alias per-technique streams)."""
    cfg = small_config(["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8", "memory.fpdt_offload=true",
                        "memory.activation_offload=memo", "memory.offload_fraction=0.25"])
    model, ctx = build(cfg)
    bufs = ctx.fpdt.buffers(torch.device("cpu"))
    assert (bufs.d2h, bufs.h2d) == (ctx.memo.offload_stream, ctx.memo.prefetch_stream)
    assert bufs.d2h is not bufs.h2d and bufs.d2h.name == "offload" and bufs.h2d.name == "prefetch"


def test_plan_capture_counts_device_storages_and_runs_backward_outside_autocast():
    """The memory plan's trace: a CUDA capture leaves host (pinned) storages out; the forward runs under the
    training autocast and the backward outside it, as in the training step."""
    from megatron_lc.planning.capture.record import DispatchTracer, capture_iteration

    with DispatchTracer("cuda") as t:
        torch.empty(1000)
    assert t.events == []
    with DispatchTracer() as t:
        torch.empty(1000)
    assert [e.op for e in t.events] == ["malloc", "free"]
    cfg = small_config([])
    model, ctx = build(cfg)
    seen = []
    layer = model.layers[0]
    layer.register_forward_pre_hook(lambda m, a: seen.append(("fwd", torch.is_autocast_enabled("cpu"))))
    layer.register_full_backward_hook(lambda m, gi, go: seen.append(("bwd", torch.is_autocast_enabled("cpu"))))
    capture_iteration(model, batch_for(cfg), ctx.arena, autocast=bf16)
    assert ("fwd", True) in seen and ("bwd", False) in seen and ("bwd", True) not in seen, seen


def test_fpdt_keeps_autocast_weight_casts_on_the_device():
    """Under autocast the QKV linear saves its bf16 weight cast; FPDT's offload keeps it (one per forward, shared by
    the chunks), it does not copy it to the host per chunk."""
    from megatron_lc.attention.fpdt.buffers import FPDTBuffers

    cfg = small_config(["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8", "memory.fpdt_offload=true"])
    model, _ = build(cfg)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    hosted = []
    original = FPDTBuffers.to_host

    def to_host(self, t, *a, **k):
        hosted.append(tuple(t.shape))
        return original(self, t, *a, **k)

    FPDTBuffers.to_host = to_host
    try:
        b = batch_for(cfg)
        with bf16():
            loss = model(b["tokens"], b["position_ids"], b["labels"]).float().mean()
        loss.backward()
    finally:
        FPDTBuffers.to_host = original
    assert hosted and not shapes & set(hosted), sorted(shapes & set(hosted))
