"""T2, continued. (1) Asynchronous vs synchronised copies: Memo and FPDT offload with their copies on the side
streams (as they run) vs on the compute stream with a device synchronize at every event the copies record; loss
and every gradient within 1e-6 relative. (2) The framework's byte accounting (``device.BufferAccount``) within 5%
of what the CUDA allocator says for the same buffers: Memo's rounding buffers (``memory_allocated`` before and
after they are allocated), and an FPDT block's buffers (fp32, offload, u = 4): the account's peak over a forward
and over a backward against ``memory_allocated`` sampled at every account event, counted from the first event of
the window (so tensors that are not the framework's and were live before the window -- the block's input,
output, dout -- cancel out). ``max_memory_allocated`` over the window (which also holds kernel temporaries and the
block's own input/output gradients) is recorded beside them, not asserted. Dry run: the accounting side only."""
import contextlib

import pytest
import torch

from megatron_lc.attention.fpdt.block import FPDTSelfAttention
from megatron_lc.config import load_config
from megatron_lc.device import BufferAccount, DeviceAdapter
from megatron_lc.memory.memo.runtime import MemoRuntime
from megatron_lc.model.rope import RotaryEmbedding
from tests.gpu.conftest import DRYRUN
from tests.gpu.test_t2_parity import CASES, loss_and_grads
from tests.support.parity import block_parts

SYNC_RTOL = 1e-6
BYTES_RTOL = 0.05


@contextlib.contextmanager
def synchronous_copies(device):
    """Copies on the compute stream (the adapter's ``stream`` is a no-op) and a device synchronize before every
    event is recorded -- each offload / prefetch copy records one right after it is issued. Yields a call counter."""
    cls = type(DeviceAdapter.for_device(device))
    record, calls = cls.record_event, [0]

    def record_after_sync(self, stream=None):
        calls[0] += 1
        self.synchronize()
        return record(self, stream)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "stream", lambda self, stream: contextlib.nullcontext())
        mp.setattr(cls, "record_event", record_after_sync)
        yield calls


@pytest.mark.parametrize("name", ["memo-a0.25", "memo-a1", "fpdt-u4-offload"])
def test_async_copies_equal_synchronised(device, record, name):
    loss, grads = loss_and_grads(CASES[name], device)
    with synchronous_copies(device) as calls:
        ref_loss, ref_grads = loss_and_grads(CASES[name], device)
    assert calls[0] > 0, "no copy event was recorded: the synchronous mode did not reach the copies"
    err = max(((grads[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp(min=1e-30)).item()
              for k in ref_grads)
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    record("T2 async vs synchronised copies (relative)", name,
           {"loss": f"{loss_rel:.1e}", "grad_max": f"{err:.1e}", "sync_points": calls[0]})
    assert loss_rel <= SYNC_RTOL and err <= SYNC_RTOL, (loss_rel, err)


def _allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def test_memo_rounding_buffers_bytes(device, record, monkeypatch):
    seen = []
    allocate = MemoRuntime.allocate

    def measured(self, *args, **kwargs):
        acc0, mem0 = self.account.live["memo.rounding"], _allocated(self.device)
        allocate(self, *args, **kwargs)
        seen.append((self.account.live["memo.rounding"] - acc0, _allocated(self.device) - mem0))

    monkeypatch.setattr(MemoRuntime, "allocate", measured)
    loss_and_grads(CASES["memo-a0.25"], device)
    assert seen, "Memo did not allocate its rounding buffers"
    accounted, allocated = seen[-1]
    record("T2 byte accounting vs the CUDA allocator", "Memo rounding buffers",
           {"accounted_bytes": accounted, "memory_allocated_delta": allocated if device.type == "cuda" else None})
    if device.type == "cuda":
        assert abs(accounted - allocated) <= BYTES_RTOL * allocated, (accounted, allocated)


class SampledAccount(BufferAccount):
    """A ``BufferAccount`` that also reads ``memory_allocated`` at every event of a window (``start()``)."""

    def __init__(self, device):
        super().__init__()
        self.device = device

    def start(self) -> None:
        self.reset_peak()
        self.acc_base, self.mem_base, self.mem_peak = self.current, None, 0

    def acquire(self, tag, t_or_bytes):
        n = t_or_bytes if isinstance(t_or_bytes, int) else self.nbytes(t_or_bytes)
        super().acquire(tag, n)
        if self.device.type == "cuda":
            mem = torch.cuda.memory_allocated(self.device)
            if self.mem_base is None:  # this buffer is already allocated: the window starts just before it
                self.mem_base = mem - n
            self.mem_peak = max(self.mem_peak, mem - self.mem_base)

    def window(self, raw0: int) -> dict:
        out = {"accounted_peak": self.peak - self.acc_base}
        if self.device.type == "cuda":
            out.update(sampled_allocated_peak=self.mem_peak,
                       max_allocated_over_window=torch.cuda.max_memory_allocated(self.device) - raw0)
        return out


def test_fpdt_block_bytes(device, record):
    s, h, heads, kv, u = (256, 64, 8, 4, 4) if DRYRUN else (16384, 2048, 16, 4, 4)
    cfg = load_config(None, [f"model.hidden_size={h}", f"model.num_attention_heads={heads}",
                             f"model.num_query_groups={kv}", f"data.seq_length={s}", "parallel.cp_comm_type=fpdt",
                             f"memory.fpdt_chunk_size={s // u}", "memory.fpdt_offload=true"])
    parts = block_parts(cfg)
    acct = parts.ctx.fpdt.account = SampledAccount(device)
    torch.manual_seed(0)
    block = FPDTSelfAttention(cfg.model, parts, 0, 0.02).to(device)
    pos = torch.arange(s, device=device).view(s, 1)
    rope = RotaryEmbedding(h // heads, 10000.0).to(device)(pos)
    x = torch.randn(s, 1, h, device=device, requires_grad=True)
    dy = torch.randn(s, 1, h, device=device)
    pool = getattr(parts.ctx.fpdt, "pool", None)  # the host pool the parked chunks come from, where there is one
    if pool is not None:  # an upper bound of what one block parks (q, k, v, out, lse, its input; dout, dq)
        pool.reserve("gpu-check", 8 * x.numel() * x.element_size())
    figures = {}
    for phase in ("forward", "backward"):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        raw0 = _allocated(device)
        acct.start()
        if phase == "forward":
            y = block(x, rope)
        else:
            y.backward(dy)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        figures[phase] = acct.window(raw0)
    assert acct.current == 0, acct.summary()
    record("T2 byte accounting vs the CUDA allocator", f"FPDT block fp32 s={s} h={h} u={u} offload", figures)
    if device.type == "cuda":
        for phase, f in figures.items():
            got, want = f["accounted_peak"], f["sampled_allocated_peak"]
            assert abs(got - want) <= BYTES_RTOL * want, (phase, f)
