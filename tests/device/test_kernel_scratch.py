"""What CUDA's kernels hold inside themselves (``device/kernel_scratch.py``), as the rehearsal charges it: the table
read against PyTorch's sources, a planted non-contiguous ``index_put_(accumulate=True)`` moving the traced peak by
the copy CUDA makes, and the variable-length backward adding into its fp32 accumulators without copying them."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.attention.ranges import block_rects, spans
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.device.kernel_scratch import (CUBLAS_WORKSPACE, KernelScratch, Scratch, total, varlen_backward)
from megatron_lc.planning.capture.tracker import DispatchTracer
from megatron_lc.rehearsal.standin import install
from tests.attention.test_ranges import StandInVarlen, VarlenOnCPU

DEVICE = install()
GIB = 1 << 30


def charged_peak(step) -> tuple:
    """(peak device bytes, charges) of ``step`` under the rehearsal's tracer with the kernels' charges on top."""
    tracer, seen = DispatchTracer(), []

    def charge(func, items):
        seen.extend(items)
        tracer.charge(str(DEVICE), [(s.nbytes, s.what, s.kept) for s in items])

    with FakeTensorMode(), tracer, KernelScratch(DEVICE, charge):
        step()
    return tracer.peak(str(DEVICE)).bytes, seen


def test_a_planted_non_contiguous_index_put_moves_the_peak_by_the_copy():
    """A 1 GiB fp32 accumulator ``[b, n, s, d]`` written through its ``[b, s, n, d]`` transpose with
    ``index_put_(accumulate=True)``: CUDA's ``index_put_with_sort_kernel`` makes ``self`` contiguous first (Indexing.cu:
    ``auto self_ = self_contiguous ? self : self.contiguous();``). The same op on the contiguous layout needs only the
    sort's indices: the peaks differ by exactly the accumulator's bytes."""
    n_idx = 1024

    def step(transposed: bool):  # the target [b, s, n, d] = [1, 32768, 8, 1024], 1 GiB fp32, either way
        target = torch.zeros(1, 8, 1 << 15, 1024, device=DEVICE).transpose(1, 2) if transposed else \
            torch.zeros(1, 1 << 15, 8, 1024, device=DEVICE)
        idx = (torch.zeros(n_idx, dtype=torch.long, device=DEVICE), torch.arange(n_idx, device=DEVICE))
        value = torch.ones(n_idx, *target.shape[2:], device=DEVICE)
        target.index_put_(idx, value, accumulate=True)

    plain, plain_charges = charged_peak(lambda: step(False))
    planted, planted_charges = charged_peak(lambda: step(True))
    assert planted - plain == 1 * GIB  # (the indices' charge is at the same moment in both)
    assert [c.what for c in planted_charges if c.nbytes == GIB] == ["index_put_ accumulate: self made contiguous"]
    assert total(plain_charges) == 4 * 8 * n_idx  # the sort's int64 indices alone


def test_the_varlen_backward_adds_into_its_accumulators_without_copying_them():
    """``backward_rects`` on the variable-length path (stand-in kernels, fp32, 2 batch rows, documents, 4 query /
    1 kv heads): every op it runs, read as CUDA's kernels would run it, charges no copy of an accumulator -- the grads
    go in by ``index_add_`` on each row's ``[n, s, d]`` slice (the ``index_put_`` on the accumulators' transposes
    it replaced charged a whole fp32 dq, dk, dv per call)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=g)
    k, v = (torch.randn(2, 1, 32, 8, generator=g) for _ in range(2))
    rects = block_rects(DocumentRanges(((0, 9, 20, 32), (0, 32))), None, spans([(0, 32)]), spans([(0, 32)]))
    backend = VarlenOnCPU(varlen=StandInVarlen())
    out, lse = backend.forward_rects(q, k, v, rects)
    charges = []
    with KernelScratch(torch.device("cpu"), lambda func, items: charges.extend(items)):
        backend.backward_rects(torch.randn(q.shape, generator=g), q, k, v, out, lse, rects)
    assert not [c for c in charges if "made contiguous" in c.what], charges


def test_the_table_reads_pytorchs_allocations():
    """flash_api.cpp ``mha_varlen_bwd``: ``dq_accum`` fp32 ``[total_q + 128 * b, h, round_up(d, 32)]``,
    ``softmax_d`` fp32 ``[h, total_q + 128 * b]``, and under GQA ``dk_expanded``, ``dv_expanded`` at the query heads;
    the module doc's example (Ulysses at 4M, 4 query / 1 kv heads, 64 documents)."""
    items = varlen_backward(total_q=4 << 20, total_k=4 << 20, segments=64, nq=4, nkv=1, d=128, elem=2)
    rows = (4 << 20) + 128 * 64
    assert [s.nbytes for s in items] == [4 * rows * 4, rows * 4 * 128 * 4, 2 * (4 << 20) * 4 * 128 * 2]
    assert abs(total(items) / GIB - 16.08) < 0.005
    assert varlen_backward(1024, 1024, 1, 4, 4, 128, 2)[-1].what.startswith("flash backward: dq_accum")  # no GQA


def test_workspaces_and_communicators_are_charged_once_and_kept():
    """cuBLAS's and cuBLASLt's workspaces at the first matmul (CublasHandlePool.cpp: 32 MiB each on Hopper), NCCL's
    buffers at a communicator's first collective; kept, once each."""
    seen = []
    with FakeTensorMode(), KernelScratch(DEVICE, lambda func, items: seen.extend(items)):
        a = torch.empty(4, 4, device=DEVICE)
        a @ a
        a @ a
        torch.empty(4, 4) @ torch.empty(4, 4)  # the host's matmul: not the accelerator's kernels
    assert seen == [Scratch("cuBLAS workspace (compute stream)", CUBLAS_WORKSPACE, kept=True),
                    Scratch("cuBLASLt workspace (compute stream)", CUBLAS_WORKSPACE, kept=True)]
