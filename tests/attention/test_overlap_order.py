"""The order of calls the overlap of communication and compute depends on, which a CPU run cannot time: ring
attention posts its first k/v transfer before the diagonal block (forward and backward, with and without
rectangles); FPDT's host fetches wait on their host copies only and are posted a step ahead. Exactness of both is
tests/attention/test_cp_attention.py's and test_fpdt.py's; FSDP2's prefetch order is tests/parallel/test_fsdp.py's."""
from __future__ import annotations

import pytest
import torch

from megatron_lc.attention.backends import TorchCPUBackend
from megatron_lc.attention.fpdt import pipeline
from megatron_lc.attention.fpdt.block import FPDTSelfAttention
from megatron_lc.attention.fpdt.buffers import ChunkStore, FPDTBuffers
from megatron_lc.attention.fpdt.host_share import reserve_for_layers
from megatron_lc.attention import ring_exchange
from megatron_lc.attention.kv_plan import kv_plan
from megatron_lc.attention.ring import KV_TAG, RingCuts, ring_backward, ring_forward
from megatron_lc.config.documents import DocumentRanges
from megatron_lc.device import BufferAccount, HostPool, StreamCheck
from megatron_lc.memory.arena import Arena
from megatron_lc.model.rope import RotaryEmbedding
from megatron_lc.parallel.cp_balance import balanced_spans, zigzag_spans
from megatron_lc.parallel.topology import Topology
from tests.support.parity import block_parts, small_config


class _Pending:
    def __init__(self, log, buf):
        self.log, self.buf = log, buf

    def wait(self):
        self.log.append("wait")
        return self.buf


class RecordingRing:
    """Ring rank 0 of 2: what it posts comes back as its neighbour's (values do not matter here, the order does)."""

    size, rank = 2, 0

    def __init__(self, log):
        self.log = log
        self.topo = Topology()  # its byte and work counters

    def send_recv(self, t, tag, op):
        self.log.append(f"post {'kv' if tag == KV_TAG else 'dkv'}")
        return _Pending(self.log, t.clone())

    def exchange(self, t, to, recv, frm, tag, op):
        """The balanced layout's direct transfer (``ring_exchange.py``): the received rows come back as zeros."""
        self.log.append(f"post {'kv' if tag == ring_exchange.KV_TAG else 'dkv'}")
        return _Pending(self.log, None if recv is None else recv.zero_())


class RecordingKernel(TorchCPUBackend):
    def __init__(self, log):
        self.log = log

    def forward(self, q, k, v, causal, scale=None):
        self.log.append(f"forward {'diagonal' if causal else 'block'}")
        return super().forward(q, k, v, causal, scale)

    def backward(self, dout, q, k, v, out, lse, causal, scale=None):
        self.log.append(f"backward {'diagonal' if causal else 'block'}")
        return super().backward(dout, q, k, v, out, lse, causal, scale)

    def forward_rects(self, q, k, v, rects, scale=None, acc=None):
        self.log.append("forward rects")
        return super().forward_rects(q, k, v, rects, scale, acc)

    def backward_rects(self, dout, q, k, v, out, lse, rects, scale=None, grads=None):
        self.log.append("backward rects")
        return super().backward_rects(dout, q, k, v, out, lse, rects, scale, grads)


DOCUMENTS = DocumentRanges(((0, 5, 16),))


@pytest.mark.parametrize("cuts", [None, RingCuts(DOCUMENTS, None, zigzag_spans(16, 2)),
                                  kv_plan(DOCUMENTS, None, balanced_spans(DOCUMENTS, 16, 2, None), 16)],
                         ids=["causal", "rectangles", "balanced"])
def test_ring_posts_its_first_kv_before_the_diagonal_block(cuts):
    q, k, v = (torch.randn(1, n, 8, 4) for n in (4, 2, 2))
    log: list = []
    comm, kernel = RecordingRing(log), RecordingKernel(log)
    out, lse = ring_forward(q, k, v, comm, kernel, cuts=cuts)
    first_kernel = "forward diagonal" if cuts is None else "forward rects"  # (rects: then one call per rectangle)
    assert log[:2] == ["post kv", first_kernel] and log.index("wait") > 1, log
    log.clear()
    ring_backward(torch.randn_like(q), q, k, v, out.to(q.dtype), lse, comm, kernel, cuts=cuts)
    first_kernel = "backward diagonal" if cuts is None else "backward rects"
    assert log[:2] == ["post kv", first_kernel] and log.index("wait") > 1, log


# ---- FPDT's host fetches -----------------------------------------------------------------------------------------------
class Slots(Arena):
    """An arena whose buffers are planned slots (``PlannedArena``'s contract, without a plan)."""

    planned = True


@pytest.mark.parametrize("arena", [Arena(), Slots()], ids=["allocator", "planned-slots"])
def test_fpdt_fetch_waits_on_its_host_copy_not_on_unrelated_compute(arena):
    """A chunk parked, then compute it has nothing to do with, then its fetch: the prefetch stream waits for the
    host copy only (its buffers come from its own pool), not for that compute -- except in planned slots, whose
    bytes held other buffers. The stream-order check finds no race either way."""
    pool = HostPool()
    pool.reserve("fpdt", HostPool.block_bytes((64,), torch.float32))
    with StreamCheck() as check:
        bufs = FPDTBuffers(torch.device("cpu"), BufferAccount(), BufferAccount(), arena, pool)
        x = torch.arange(64, dtype=torch.float32)
        h = bufs.to_host(x)
        torch.ones(32, 32) @ torch.ones(32, 32)  # compute the fetch does not read
        unrelated = check.compute.clock
        fetched = bufs.fetch([h], "fpdt.fetch_kv")
        waited = check.copy_streams()[1].vec.get(check.compute, 0)
        assert torch.equal(bufs.wait(fetched)[0], x)
        del fetched
    assert (waited >= unrelated) == arena.planned, (waited, unrelated)
    assert not check.violations, check.report()


def _fpdt_block(u=4):
    cfg = small_config(["parallel.cp_comm_type=fpdt", f"memory.fpdt_chunk_size={32 // u}", "memory.fpdt_offload=true"])
    torch.manual_seed(0)
    return FPDTSelfAttention(cfg.model, block_parts(cfg), 0, 0.02), cfg


def test_fpdt_posts_each_fetch_one_step_ahead(monkeypatch):
    """Forward: the first earlier kv chunk of q chunk i is fetched before its diagonal block. Backward: the q set of
    chunk j+1 is fetched before chunk j's gradients go back through the all-to-all and the projection."""
    log: list = []
    prefetch, from_attn = ChunkStore.prefetch, pipeline._from_attn

    def logged_prefetch(self, keys, tag):
        log.append(f"fetch {keys[0][0]}{keys[0][1]}")
        return prefetch(self, keys, tag)

    def logged_from_attn(bufs, topo, t, tag):
        log.append(f"a2a back {tag}")
        return from_attn(bufs, topo, t, tag)

    for name in ("forward", "backward"):
        def call(self, *a, _orig=getattr(TorchCPUBackend, name), _name=name, **kw):
            causal = kw["causal"] if "causal" in kw else a[3 if _name == "forward" else 6]
            log.append(f"{_name} {'diagonal' if causal else 'block'}")
            return _orig(self, *a, **kw)
        monkeypatch.setattr(TorchCPUBackend, name, call)
    monkeypatch.setattr(ChunkStore, "prefetch", logged_prefetch)
    monkeypatch.setattr(pipeline, "_from_attn", logged_from_attn)
    block, cfg = _fpdt_block()
    x = torch.randn(32, 2, cfg.model.hidden_size, requires_grad=True)
    rope = RotaryEmbedding(cfg.model.kv_channels, 10000.0)(torch.arange(32).view(32, 1).expand(32, 2))
    reserve_for_layers(block, x.detach(), rope, 1)
    log.clear()
    y = block(x, rope)
    diagonals = [i for i, e in enumerate(log) if e == "forward diagonal"]
    assert len(diagonals) == 4 and all(log[i - 1] == "fetch k0" for i in diagonals[1:]), log
    log.clear()
    y.square().sum().backward()
    grads_back = [i for i, e in enumerate(log) if e == "a2a back fpdt.grad_local"]
    for j in range(3):  # chunk j's three gradients go back after chunk j+1's q set was fetched
        assert log.index(f"fetch q{j + 1}") < grads_back[3 * j], log
