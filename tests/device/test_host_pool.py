"""The host pool (``device.HostPool``): one allocation sized by the calibrations, first-fit views, exact accounting;
Memo's host copies and FPDT's parked chunks come from it and training stays exact; FPDT's dq accumulators are
never zeroed on the host.

Tolerances: tests/support/parity.py (fp32 on CPU: loss 1e-5 relative, gradients 1e-4). Between steps every byte of the
pool
is overwritten with 0xFF (NaN in fp32/bf16), so a step that read a host byte it had not written would not match."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_lc.device import DeviceAdapter, HostPool, HostPoolError
from tests.dist_cases.offload import host_budget_agreed
from tests.support.dist import run_dist
from tests.support.parity import (assert_close_grads, assert_close_loss, batch_for, build, reference_loss_and_grads,
                                  small_config)

FPDT = ["parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=8", "memory.fpdt_offload=true"]  # P = 1, u = 4
MEMO = ["memory.activation_offload=memo", "model.num_layers=4"]  # layers 0, 1 swapped
MEMO_FPDT = MEMO + FPDT + ["memory.offload_fraction=0.5"]
# host checkpoints: the forwards run without a graph (FPDT parks nothing), each layer's re-run parks its chunks and
# its backward gives them back before the next re-run: FPDT's share is one layer's F + B, not L * F + B
CKPT_FPDT = FPDT + ["memory.activation_offload=checkpoints", "model.num_layers=4"]


def cpu_pool(nbytes: int) -> HostPool:
    pool = HostPool()
    pool.bind(DeviceAdapter.for_device(torch.device("cpu")))
    pool.reserve("test", nbytes)
    return pool


def offset(pool: HostPool, t: torch.Tensor) -> int:
    return t.data_ptr() - pool.data.data_ptr()


# ---- the allocator -------------------------------------------------------------------------------------------------
def test_every_property_of_the_pool_and_its_first_fit_reads_in_every_state():
    """Each read-only property of ``HostPool`` and of the first-fit placement under it answers, before allocation,
    after it and while measuring (a property copied from one class to the other once read a field the other never
    sets)."""
    def read_all(obj):
        props = [n for n, v in vars(type(obj)).items() if isinstance(v, property)]
        return {n: getattr(obj, n) for n in props}

    pool = cpu_pool(2048)
    assert read_all(pool)["size"] == 2048
    pool.take((4,), torch.float32)
    assert read_all(pool)["used"] == 512 and read_all(pool.fit)["used"] == 512
    with pool.measuring() as fit:
        pool.take((4,), torch.float32)
        assert read_all(pool)["measuring_now"] and read_all(fit)["used"] == 512


def test_docstring_example_first_fit_alignment_and_exhaustion():
    pool = cpu_pool(2048)
    a = pool.take((100,), torch.float32)
    b = pool.take((10, 10), torch.bfloat16)
    assert pool.data.numel() == 2048  # one allocation of exactly the reserved bytes
    assert (offset(pool, a), offset(pool, b)) == (0, 512)
    assert a.shape == (100,) and a.dtype == torch.float32 and b.shape == (10, 10) and b.dtype == torch.bfloat16
    pool.give(a)
    c = pool.take((256,), torch.float32)  # 1024 bytes: [0, 512) is too small, first fit at 1024
    assert offset(pool, c) == 1024 and pool.used == 512 + 1024
    with pytest.raises(HostPoolError, match=r"1024 bytes asked .* 1536 in use of 2048 .*largest free range 512"):
        pool.take((1024,), torch.uint8)
    small = pool.take((3,), torch.float64)  # 24 bytes fit the hole at 0
    assert offset(pool, small) == 0
    for t in (small, b, c):
        pool.give(t)
    assert pool.used == 0 and pool.fit.gaps == [[0, 2048]]  # free ranges coalesce
    assert pool.high == 2048


def test_views_are_aligned_and_disjoint():
    pool = cpu_pool(64 * 1024)
    views = [pool.take((n,), torch.float32) for n in (1, 7, 128, 129, 300)]
    offs = [offset(pool, v) for v in views]
    assert all(o % HostPool.ALIGN == 0 for o in offs)
    assert offs == sorted(offs) and all(b - a >= HostPool.block_bytes(v.shape, v.dtype)
                                        for a, b, v in zip(offs, offs[1:], views))
    for i, v in enumerate(views):
        v.fill_(i)
    assert [v.unique().tolist() for v in views] == [[i] for i in range(len(views))]


def test_reserve_errors_and_foreign_tensors():
    pool = HostPool()
    with pytest.raises(HostPoolError, match="nothing was reserved"):
        pool.take((4,), torch.float32)
    pool.reserve("fpdt", 1000)
    pool.reserve("memo", 24)
    assert pool.size == 1024 + 512  # each share rounded up to ALIGN, no power-of-two rounding
    t = pool.take((4,), torch.float32)
    assert pool.data.numel() == 1536
    with pytest.raises(HostPoolError, match=r"memo reserves 10 bytes after the pool was allocated \(1536 bytes"):
        pool.reserve("memo", 10)
    with pytest.raises(HostPoolError, match="not a block of this pool"):
        pool.give(torch.empty(4))
    pool.give(t)
    with pytest.raises(HostPoolError, match="cannot serve meta"):
        pool.bind(DeviceAdapter(torch.device("meta")))


def test_blocks_are_found_by_storage_offset_under_fake_tensors():
    """A block given back is found by its offset in the pool's storage, not by its address: torch warns that a fake
    tensor's ``data_ptr()`` is deprecated and will become an error, so the rehearsal (fake tensors) read it on every
    give back, once per parked chunk."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pool = cpu_pool(2048)
        a = pool.take((100,), torch.float32)  # [0, 512)
        b = pool.take((10, 10), torch.bfloat16)  # [512, 1024)
        pool.give(b)
        assert sorted(pool.fit.live) == [0]  # b's block came back, a's is still held
        pool.give(a)
        assert pool.used == 0
        with pytest.raises(HostPoolError, match="not a block of this pool"):
            pool.give(torch.empty(4))
    assert not [w for w in seen if "data pointer" in str(w.message)], [str(w.message)[:80] for w in seen]

class _Event:
    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def test_a_block_still_copied_is_not_handed_out_before_its_event():
    pool = cpu_pool(1024)
    a = pool.take((128,), torch.float32)
    ev = _Event()
    pool.give(a, after=ev)  # a side-stream copy still reads it
    assert not ev.done
    b = pool.take((128,), torch.float32)  # first fit lands on a's range: handed out after waiting for the copy
    assert ev.done and offset(pool, b) == 0
    c = pool.take((128,), torch.float32)
    assert offset(pool, c) == 512


def test_placement_does_not_depend_on_when_copies_finish():
    """The CPU twin's events are complete at once; a GPU's may not be. Both must place the blocks alike, or a pool
    sized on the CPU fragments on the GPU: here b would land at 512 beside a still-copied a, and c (1024 bytes)
    would find [0, 512) and [1024, 1536) free but no 1024 bytes together."""
    for ev in (None, _Event()):
        pool = cpu_pool(1536)
        a = pool.take((128,), torch.float32)
        pool.give(a, after=ev)
        b = pool.take((128,), torch.float32)
        c = pool.take((256,), torch.float32)
        assert (offset(pool, b), offset(pool, c)) == (0, 512)


def test_measuring_hands_out_plain_tensors_and_counts_the_first_fit():
    pool = HostPool()
    with pool.measuring() as fit:
        x = pool.take((1000,), torch.float32)  # 4096 bytes (aligned)
        y = pool.take((3,), torch.float32)
        pool.give(x)
        pool.take((10,), torch.uint8)  # first fit at 0
        assert y.data_ptr() != 0 and pool.data is None
    assert fit.high == 4096 + 512 and pool.data is None


# ---- the techniques: exact accounting and exact training -------------------------------------------------------------
def train_steps(over, steps: int = 2):
    """``steps`` forward/backward passes of one batch (gradients accumulate) with the pool overwritten with 0xFF
    before each; returns (model, context, mean token loss of the last step)."""
    cfg = small_config(over)
    model, ctx = build(cfg)
    batch = batch_for(cfg)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if ctx.host_pool.data is not None:
            ctx.host_pool.data.fill_(255)
        tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
        loss = (tok * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
        loss.backward()
    return cfg, model, ctx, float(loss.detach()), batch


@pytest.mark.parametrize("over", [FPDT, MEMO, MEMO_FPDT, CKPT_FPDT], ids=["fpdt", "memo", "memo+fpdt", "ckpt+fpdt"])
def test_offload_training_is_exact_and_the_pool_is_sized_to_the_byte(over):
    cfg, model, ctx, loss, batch = train_steps(over)
    ref_loss, ref_grads = reference_loss_and_grads(cfg, batch)
    assert_close_loss(loss, ref_loss)
    assert_close_grads({n: p.grad for n, p in model.named_parameters()}, ref_grads)
    pool = ctx.host_pool
    assert pool.data.numel() == pool.size == sum(pool.reserved.values())  # one allocation, exactly the shares
    # a step reaches the end of the pool and no further: the sizing is tight -- with the host checkpoints, less
    # one layer input: a re-run gives its input's block back before its FPDT chunks park (the shares' peaks are
    # one block apart; 16 KiB of 162 KiB here, 2 of 176 GiB at Llama3-8B x 1M, cp 8)
    spare = pool.reserved.get("checkpoints", 0) // cfg.model.num_layers if ctx.fpdt is not None else 0
    assert pool.high == pool.size - spare
    if ctx.fpdt is not None:
        assert ctx.fpdt.host_account.current == 0  # every parked chunk given back
        assert ctx.fpdt.host_account.peak == pool.reserved["fpdt"]  # what FPDT held at most = its share
    if ctx.memo is not None:
        assert ctx.memo.host_bytes() == pool.reserved["memo"]  # the host copies are the Memo share
        assert ctx.memo.host_bytes() == 2 * ctx.memo.buffers[0].capacity  # 2 swapped layers x one buffer
        assert pool.used == pool.reserved["memo"]  # between steps only Memo's copies are held
        assert pool.size <= ctx.memo.profile.host_budget  # the alpha LP's budget holds the pool's real bytes


def test_memo_host_memory_error_counts_the_pool():
    """A budget smaller than the pool (FPDT's chunks + Memo's copies at alpha 0) is an error naming the numbers."""
    from megatron_lc.memory.memo.alpha import HostMemoryError

    with pytest.raises(HostMemoryError, match=r"share \S+ bytes less the host pool.s \S+ bytes of FPDT chunks"):
        build(small_config(MEMO_FPDT[:-1] + ["memory.offload_fraction=0", "memory.host_memory_gb=0.0002"]))


class _HostWrites(TorchDispatchMode):
    """Counts zero_/fill_ calls on tensors that live in ``pool``'s allocation."""

    def __init__(self, pool: HostPool):
        super().__init__()
        self.lo, self.hi = pool.data.data_ptr(), pool.data.data_ptr() + pool.size
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.zero_.default, torch.ops.aten.fill_.Scalar) and isinstance(args[0], torch.Tensor):
            if self.lo <= args[0].data_ptr() < self.hi:
                self.calls += 1
        return func(*args, **(kwargs or {}))


def test_fpdt_never_zeroes_host_dq_accumulators():
    cfg, model, ctx, _, batch = train_steps(FPDT, steps=1)
    mode = _HostWrites(ctx.host_pool)
    with mode:
        tok = model(batch["tokens"], batch["position_ids"], batch["labels"])
        tok.sum().backward()
    assert mode.calls == 0


def test_cuda_pool_page_locks_exactly_its_bytes(monkeypatch):
    """The CUDA mapping (never run on a GPU here): one ``cudaHostRegister`` of exactly the pool's bytes -- not
    ``pin_memory=True``, which rounds up to a power of two -- and the pages unlocked when the pool goes."""
    import gc

    from megatron_lc.device import adapter as device_mod

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "check_error", lambda res: None)
    pool = HostPool()
    pool.bind(device_mod._CudaAdapter(torch.device("cuda", 0)))
    pool.reserve("fpdt", 3 * 1024 * 1024 + 1)  # 3 MiB + 512: a power-of-two allocator would take 4 MiB
    t = pool.take((4,), torch.float32)
    ptr = pool.data.data_ptr()
    assert calls == [("register", ptr, 3 * 1024 * 1024 + 512)] and offset(pool, t) == 0
    del pool, t
    gc.collect()
    assert calls[-1] == ("unregister", ptr)


def test_setup_allocates_the_pool_and_a_refused_page_lock_is_one_line(monkeypatch):
    """The pool is allocated (page-locked on CUDA) when setup has every reservation, not lazily in the first
    forward: there a refused ``cudaHostRegister`` leaves one rank failing while the others wait for it in p2p. Setup
    says it in one line naming the bytes."""
    _, ctx = build(small_config(FPDT))
    assert ctx.host_pool.data is not None and ctx.host_pool.data.numel() == ctx.host_pool.size

    def refused(self, nbytes):
        raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(DeviceAdapter, "host_pinned", refused)
    with pytest.raises(HostPoolError) as e:
        build(small_config(FPDT))
    assert "\n" not in str(e.value) and "could not allocate and page-lock" in str(e.value), str(e.value)
    assert str(e.value).endswith("CUDA error: out of memory"), str(e.value)


def test_the_host_budget_is_agreed_by_the_nodes_ranks_before_anyone_pins():
    """Two ranks of a node with a 30 GiB pool each: rank 0 reads a 40 GiB share, rank 1 reads 28 (it read after a
    neighbour pinned; ``MemAvailable`` planted). Each rank deciding alone, rank 0 would go on into its first
    collective and rank 1 refuse alone; agreed (the node's smallest reading, decided on every rank), both refuse
    with the same one line. With room on both, both go on."""
    said = run_dist(2, host_budget_agreed, [40, 28])
    assert said[0] == said[1] and said[0].startswith("rank 0: the host pool needs 30.00 GiB (fpdt 30.00 GiB), over "
                                                     "this rank's share 28.00 GiB"), said
    assert "\n" not in said[0]
    assert run_dist(2, host_budget_agreed, [40, 31]) == ["fits", "fits"]
