"""T7: what CUDA's kernels allocate inside themselves, measured against ``device/kernel_scratch.py``'s table (which the
rehearsal and the estimator charge): per op, the device's peak allocated bytes while it runs above its inputs and
outputs (``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``), beside the table's charge for the
same arguments. Recorded for every op; asserted within 25% (+ 8 MiB of the kernels' small scratch: the sort's
temporary storage, cuDNN's other buffers). Ops: the flash backward with GQA, the variable-length backward with
GQA, cuDNN's backward (where it runs), ``index_put_(accumulate=True)`` on a transposed fp32 target (the hidden copy
the rectangles' backward no longer makes). Dry run: the charges computed on CPU tensors (the table's plumbing), no
measurement."""
import pytest
import torch

from megatron_lc.attention.fused_cuda import rng_placeholders
from megatron_lc.attention.hopper import unavailable
from megatron_lc.device.kernel_scratch import KernelScratch, total

MIB = 1 << 20
SECTION = "T7 kernels' own workspaces vs device/kernel_scratch.py"


def _ops(device):
    """name -> (op thunk) at moderate sizes: 1 x 8 query / 2 kv heads x 8192 x 128, bf16."""
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    s, nq, nkv, d = (8192, 8, 2, 128) if device.type == "cuda" else (256, 4, 2, 16)

    def bnsd(n):  # [b, n, s, d] views of [s, b, n, d] tensors, as the cores pass them
        return torch.randn(s, 1, n, d, generator=g, device=device, dtype=dt).permute(1, 2, 0, 3)

    q, k, v, dout = bnsd(nq), bnsd(nkv), bnsd(nkv), bnsd(nq)
    ops = {}
    if device.type == "cuda":
        aten = torch.ops.aten
        out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[:2]
        ops["flash backward (GQA)"] = lambda: aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, s, s, 0.0, True, *rng_placeholders(q))
        qp, kp, vp, dp = (t.transpose(1, 2)[0].contiguous() for t in (q, k, v, dout))  # [s, n, d] packed
        cu = torch.tensor([0, s // 2, s], dtype=torch.int32, device=device)
        o_p, l_p, _ = torch.ops.torch_attn._varlen_attn(qp, kp, vp, cu, cu, s // 2, s // 2, True, None, [-1, -1])
        ops["varlen backward (GQA)"] = lambda: torch.ops.torch_attn._varlen_attn_backward(
            dp, qp, kp, vp, o_p, l_p, cu, cu, s // 2, s // 2, True, rng_placeholders(q)[0], None, [-1, -1])
        if unavailable("cudnn", device) is None:
            res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)
            ops["cuDNN backward"] = lambda: aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, res[0], res[1], *rng_placeholders(q, flash=False), None, None, None, s, s, 0.0, True)
    acc = torch.zeros(1, nq, s, d, device=device)
    pos = torch.arange(s // 2, device=device)
    rows = torch.zeros_like(pos)
    src = torch.randn(s // 2, nq, d, generator=g, device=device)
    ops["index_put_ accumulate, transposed target"] = lambda: acc.transpose(1, 2).index_put_((rows, pos), src,
                                                                                            accumulate=True)
    return ops


def _charged(device, thunk) -> int:
    seen = []
    with KernelScratch(device, lambda func, items: seen.extend(items)):
        thunk()
    return total([x for x in seen if not x.kept])


def _measured(device, thunk) -> int:
    """The device's peak allocated bytes above the op's inputs and outputs while it runs."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = thunk()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)  # its outputs held (an in-place op: none)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return peak - after if after >= before else peak - before


def test_the_kernels_workspaces_are_the_tables(device, record):
    for name, thunk in _ops(device).items():
        thunk()  # warm-up: cuBLAS / cuDNN handles, graphs, lazy inits
        charged = _charged(device, thunk)
        if device.type != "cuda":
            record(SECTION, f"{name}: charged (dry run, CPU shapes)", charged)
            continue
        measured = _measured(device, thunk)
        record(SECTION, f"{name}: measured / charged MiB", f"{measured / MIB:.1f} / {charged / MIB:.1f}")
        assert abs(measured - charged) <= 0.25 * charged + 8 * MIB, (name, measured, charged)
    if device.type != "cuda":
        pytest.skip("dry run: charges computed, nothing measured")
