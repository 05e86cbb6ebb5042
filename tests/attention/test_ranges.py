"""Masks as ranges: the host's document offsets, the cut of a block into rectangles (every visible pair exactly once,
nothing else), their run through the CPU kernel and through the variable-length kernel's wrapping (a CPU stand-in of
``torch_attn::_varlen_attn`` and its backward), against SDPA with the dense mask; the varlen path's shapes under
fake tensors (what the rehearsal runs).

Tolerance: fp32 kernels differ from SDPA by summation order (~1e-6 absolute on O(1) values); each merge of two
partial results by lse adds one exp/log per element (~1e-7 relative): 1e-5 is an order above both."""
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_lc.attention.backends import MathBackend, TorchCPUBackend
from megatron_lc.attention.fused_cuda import TorchCUDABackend
from megatron_lc.attention.masks import attended_pairs
from megatron_lc.attention.ranges import ANTI, CAUSAL, FULL, block_rects, spans
from megatron_lc.config.documents import DocumentRanges
from tests.attention.test_attention_backends import StandInKernels

TOL = 1e-5


def dense_visible(cu, window, q_pos, k_pos) -> np.ndarray:
    """[len(q_pos), len(k_pos)] int: 1 where query i sees key j (same document, j <= i, i - j < window)."""
    ids = np.repeat(np.arange(len(cu) - 1), np.diff(cu)) if cu else None
    out = np.zeros((len(q_pos), len(k_pos)), dtype=int)
    for a, i in enumerate(q_pos):
        for b, j in enumerate(k_pos):
            out[a, b] = j <= i and (window is None or i - j < window) and (ids is None or ids[i] == ids[j])
    return out


def covered(rects, nq, nk) -> np.ndarray:
    """How many times the rectangles count each (query, key) pair."""
    out = np.zeros((nq, nk), dtype=int)
    for r in rects:
        for p in range(r.q1 - r.q0):
            for c in range(r.k1 - r.k0):
                out[r.q0 + p, r.k0 + c] += r.kind == FULL or (r.kind == CAUSAL and c <= p) or (r.kind == ANTI and c >= p)
        assert r.kind == FULL or r.q1 - r.q0 == r.k1 - r.k0, r
    return out


def test_rectangles_cover_every_visible_pair_once_and_nothing_else():
    """2000 random blocks: documents, windows 1..50 or none, query and key spans in any order (a ring rank's
    zigzag chunks, a later rank's keys) -- exact integers, no tolerance."""
    rng = random.Random(0)
    for _ in range(2000):
        s = rng.randint(2, 40)
        cu = (0, *sorted(rng.sample(range(1, s), rng.randint(0, min(6, s - 1)))), s) if rng.random() < 0.7 else None
        window = rng.choice([None, 1, 2, 3, 5, 8, 50]) if cu else rng.choice([1, 2, 3, 5, 8, 50])

        def some_spans():
            n = rng.randint(1, min(3, (s + 1) // 2))
            pts = sorted(rng.sample(range(s + 1), 2 * n))
            out = [(pts[2 * i], pts[2 * i + 1]) for i in range(n)]
            return out[::-1] if rng.random() < 0.3 else out

        qg, kg = some_spans(), some_spans()
        rects = block_rects(DocumentRanges((cu,)) if cu else None, window, spans(qg), spans(kg))
        q_pos = [i for a, b in qg for i in range(a, b)]
        k_pos = [i for a, b in kg for i in range(a, b)]
        assert (covered(rects, len(q_pos), len(k_pos)) == dense_visible(cu, window, q_pos, k_pos)).all(), (cu, window)


def test_ring_example_of_the_docstring():
    docs = DocumentRanges.from_ids([[0, 0, 0, 1, 1, 2, 2, 2]])
    rank0, rank1 = spans([(0, 2), (6, 8)]), spans([(2, 4), (4, 6)])
    assert docs.cu == ((0, 3, 5, 8),) and docs.within(0, 2, 6) == [(2, 3), (3, 5), (5, 6)]
    assert [tuple(r)[0:1] + tuple(r)[2:] for r in block_rects(docs, None, rank0, rank1)] == [(FULL, 2, 4, 3, 4)]
    assert [tuple(r)[0:1] + tuple(r)[2:] for r in block_rects(docs, None, rank1, rank0)] == [(FULL, 0, 1, 0, 2)]
    assert len(block_rects(docs, None, rank1, rank1)) == 3  # one causal square per document


def test_a_window_costs_s_times_w_in_rectangles_of_at_most_w():
    """No documents, 4096 tokens, W = 64: every rectangle at most W a side, their computed pairs ~ s * W."""
    s, w = 4096, 64
    rects = block_rects(None, w, ((0, s, 0),), ((0, s, 0),))
    assert max(max(r.q1 - r.q0, r.k1 - r.k0) for r in rects) <= w
    work = sum((r.q1 - r.q0) * (r.k1 - r.k0) / (1 if r.kind == FULL else 2) for r in rects)
    assert s * w * 0.9 <= work <= s * w * 1.1, work


def test_document_ranges_from_the_data():
    tokens = np.array([[5, 9, 1, 5, 9, 9], [9, 5, 5, 5, 5, 5]])  # EOD = 9 ends a document
    docs = DocumentRanges.from_eod(tokens, 9)
    assert docs.cu == ((0, 2, 5, 6), (0, 1, 6)) and docs.seq_length == 6 and docs.to("cuda") is docs
    assert docs.ids().tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert DocumentRanges.from_ids(docs.ids()) == docs and hash(DocumentRanges.from_ids(docs.ids())) == hash(docs)
    # 2 + 3 + 1 and 1 + 5 tokens; a window of 2: 2 + (2 + 2) + 0.5 and 0.5 + (2 + 3 * 2)
    assert docs.attended_pairs() == 2 + 4.5 + 0.5 + 0.5 + 12.5 and docs.attended_pairs(2) == 2 + 4 + 0.5 + 0.5 + 8
    assert attended_pairs(docs, [2, None], 6) == (15 + 20) / 2
    assert attended_pairs(None, [2], 6, rows=2) == 2 * (2 + 4 * 2)


def dense_reference(q, k, v, cu_rows, window, q_pos, k_pos, dout):
    """SDPA with the dense mask of the block (rows that see nothing: out 0)."""
    vis = torch.stack([torch.from_numpy(dense_visible(cu, window, q_pos, k_pos)).bool() for cu in cu_rows])
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = (q @ k.repeat_interleave(rep, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~vis[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    out = p @ v.repeat_interleave(rep, 1)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


class StandInVarlen:
    """CPU stand-ins of ``torch_attn::_varlen_attn`` and ``_varlen_attn_backward`` (packed ``[total, n, d]``, lse
    ``[n, total_q]``, GQA), computed per ``cu_seq`` segment by ``MathBackend``; a causal segment must be square
    (the only kind the wrapping sends: the real kernel would align it bottom-right)."""

    math = MathBackend()

    @staticmethod
    def _segments(cu_q, cu_k):
        return list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:]))

    @staticmethod
    def _bnsd(t, a, b):
        return t[None, a:b].transpose(1, 2)

    def _varlen_attn(self, q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, window, *rest):
        # (the first ten arguments: every torch with the op has them; the flash kernel takes fewer kv heads)
        assert window == [-1, -1] and cu_q.dtype == torch.int32 and not rest and q.shape[1] % k.shape[1] == 0
        out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0])
        for a, b, c, e in self._segments(cu_q, cu_k):
            assert not is_causal or b - a == e - c and b - a <= max_q
            o, l = self.math.forward(self._bnsd(q, a, b), self._bnsd(k, c, e), self._bnsd(v, c, e), is_causal, scale)
            out[a:b], lse[:, a:b] = o[0].transpose(0, 1), l[0]
        return out, lse, torch.zeros(2)

    def _varlen_attn_backward(self, do, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, rng, scale, window):
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, c, e in self._segments(cu_q, cu_k):
            t = self._bnsd
            gq, gk, gv = self.math.backward(t(do, a, b), t(q, a, b), t(k, c, e), t(v, c, e), t(out, a, b),
                                            lse[None, :, a:b], is_causal, scale)
            dq[a:b] += gq[0].transpose(0, 1)
            dk[c:e] += gk[0].transpose(0, 1)
            dv[c:e] += gv[0].transpose(0, 1)
        return dq, dk, dv


class VarlenOnCPU(TorchCUDABackend):
    """The bf16 / fp16 branch (the variable-length kernel) exercised in fp32 with the stand-in ops."""

    def _uses_varlen(self, q):
        return True


BACKENDS = [TorchCPUBackend(), MathBackend(), VarlenOnCPU(varlen=StandInVarlen()), TorchCUDABackend(ops=StandInKernels())]


@pytest.mark.parametrize("backend", BACKENDS, ids=["torch-cpu", "math", "cuda-varlen-wrapping", "cuda-fp32-per-rect"])
@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_rectangles_equal_the_dense_masked_attention(backend, window, heads):
    """Two batch rows with different documents; queries [20, 40) (a later span) against keys of two spans in zigzag
    order: full blocks, causal diagonals, window edges, rows that see no key (out 0, lse -inf, no gradient)."""
    g = torch.Generator().manual_seed(1)
    cu_rows = [(0, 5, 6, 23, 31, 40), (0, 40)]
    q_g, k_g = [(20, 30), (30, 40)], [(0, 10), (25, 40)]
    q_pos = [i for a, b in q_g for i in range(a, b)]
    k_pos = [i for a, b in k_g for i in range(a, b)]
    q = torch.randn(2, heads[0], len(q_pos), 8, generator=g)
    k, v = (torch.randn(2, heads[1], len(k_pos), 8, generator=g) for _ in range(2))
    dout = torch.randn(q.shape, generator=g)
    rects = block_rects(DocumentRanges(tuple(cu_rows)), window, spans(q_g), spans(k_g))
    out, lse = backend.forward_rects(q, k, v, rects)
    ref_out, ref_lse, *ref_grads = dense_reference(q, k, v, cu_rows, window, q_pos, k_pos, dout)
    seen = torch.isfinite(ref_lse)
    assert not seen.all() and torch.equal(torch.isfinite(lse), seen)  # some rows see nothing here
    assert (out - ref_out).abs().max() <= TOL and (lse[seen] - ref_lse[seen]).abs().max() <= TOL
    grads = backend.backward_rects(dout, q, k, v, out, lse, rects)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.float32 and (got - want).abs().max() <= TOL


def test_rectangles_merge_into_given_accumulators():
    """Ring and FPDT merge every block into one pair of accumulators: two key blocks one after the other equal one
    call over both."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g) for _ in range(3))
    docs = DocumentRanges(((0, 7, 16),))
    whole = block_rects(docs, 5, ((0, 16, 0),), ((0, 16, 0),))
    for backend in BACKENDS:
        out, lse = backend.forward_rects(q, k, v, whole)
        acc = backend.forward_rects(q, k[:, :, :8], v[:, :, :8], block_rects(docs, 5, ((0, 16, 0),), ((0, 8, 0),)))
        backend.forward_rects(q, k[:, :, 8:], v[:, :, 8:], block_rects(docs, 5, ((0, 16, 0),), ((8, 16, 0),)),
                              acc=acc)
        assert (acc[0] - out).abs().max() <= TOL and (acc[1] - lse).abs().max() <= TOL


def test_varlen_path_runs_under_fake_tensors():
    """The rehearsal's stand-in device: the real ``torch_attn`` ops' fake kernels give the shapes (bf16, GQA)."""
    docs = DocumentRanges(((0, 100, 300, 1024),))
    rects = block_rects(docs, 64, ((0, 1024, 0),), ((0, 1024, 0),))
    with FakeTensorMode():
        q = torch.randn(1, 8, 1024, 64, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 2, 1024, 64, dtype=torch.bfloat16) for _ in range(2))
        backend = TorchCUDABackend()
        out, lse = backend.forward_rects(q, k, v, rects)
        grads = backend.backward_rects(torch.randn_like(q), q, k, v, out.to(q.dtype), lse, rects)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and [t.shape for t in grads] == [q.shape, k.shape, k.shape]


def test_plain_model_attention_is_untouched_without_masks():
    """No documents, no window: no rectangles (the callers' causal kernel call, as before)."""
    assert block_rects(None, None, ((0, 8, 0),), ((0, 8, 0),)) is None
    x = torch.randn(1, 2, 8, 4)
    assert torch.allclose(TorchCPUBackend().forward(x, x, x, True)[0], F.scaled_dot_product_attention(x, x, x,
                                                                                                     is_causal=True),
                          atol=TOL)


def test_varlen_calls_are_cut_at_max_call_rows_and_still_exact(monkeypatch):
    """What a variable-length call gathers and what the kernel holds inside itself grow with its rows
    (``fused_cuda.MAX_CALL_ROWS``): with the cap at 12 rows the block's rectangles go in calls of at most 12 query
    and 12 key rows (a larger rectangle alone), forward and backward, and the results are the dense masked
    attention's, as with one call per kind."""
    from megatron_lc.attention import fused_cuda

    monkeypatch.setattr(fused_cuda, "MAX_CALL_ROWS", 12)
    docs = DocumentRanges(((0, 5, 6, 23, 31, 40), (0, 40)))
    rects = block_rects(docs, 7, spans([(20, 30), (30, 40)]), spans([(0, 10), (25, 40)]))
    for forward in (True, False):
        for call in fused_cuda.calls(fused_cuda._per_row(rects, 2), forward):
            segments = len(call.cu_q) - 1
            assert segments == 1 or (call.cu_q[-1] <= 12 and call.cu_k[-1] <= 12), (forward, call.cu_q, call.cu_k)
    test_rectangles_equal_the_dense_masked_attention(BACKENDS[2], 7, (4, 1))
