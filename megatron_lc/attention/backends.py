"""Local attention kernels that return the log-sum-exp, behind one interface.

    out, lse = backend.forward(q, k, v, causal)                 # q [b, nq, sq, d]; k, v [b, nkv, sk, d]
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, causal)
    out, lse = backend.forward_rects(q, k, v, rects, acc=None)  # documents / windows: ``ranges.py``'s rectangles
    dq, dk, dv = backend.backward_rects(dout, q, k, v, out, lse, rects, grads=None)

``out`` has q's dtype, ``lse`` is fp32 ``[b, nq, sq]`` (natural log). GQA: nq may be a multiple of nkv; dk/dv have
k's shape (gradients of the query heads sharing a kv head are summed). ``causal`` is only used with sq == sk
(diagonal blocks); off-diagonal blocks of ring/FPDT are full (``causal=False``) or skipped. Under document masks or a
sliding window a block is a list of rectangles (``ranges.py``), never a mask: the ``_rects`` pair returns / adds
into fp32 accumulators; a query row that sees no key of the block keeps out 0 and lse -inf (the merge then ignores
it) and gets no gradient from the block. The CPU kernels run the rectangles one call each (``piecewise.py``); on
CUDA, PyTorch's variable-length kernel takes them in a few calls (``fused_cuda.py``).

Backends:
  * ``torch``: PyTorch's own fused kernels -- on CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` and its
    backward (what the tests run); on CUDA ``fused_cuda.TorchCUDABackend`` (flash for bf16/fp16, memory-efficient
    for fp32 and masks; never executed here). ``auto`` on a GPU without a measured table (``kernel_table.py``).
  * ``cudnn``, ``fa3``, ``fa4``: cuDNN's fused attention (stock PyTorch) and FlashAttention-3 / 4 through PyTorch's
    registry (``hopper.py``; GQA native, never executed here).
  * ``auto``: on a GPU the fastest backend of the table ``bench/attention_kernels.py`` measured on it (or its
    generation) that this process can run (``auto_choice``); on CPU ``torch``.
  * ``math``: plain matmul/softmax on any device (the reference; O(s^2) memory: only when named).
  * ``flash``: flash-attn 2's ``_flash_attn_forward/_flash_attn_backward`` (GPU; never executed here).
  * ``te``: TransformerEngine's ``fused_attn_fwd/fused_attn_bwd`` (GPU; never executed here).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Optional

import torch

from ..config import ConfigError
from ..config.combinations import CUDA_ONLY
from .fused_cuda import TorchCUDABackend
from .hopper import CudnnBackend, RegisteredFlashBackend, unavailable
from .kernel_table import table_for_gpu
from .piecewise import ByRectangles

log = logging.getLogger(__name__)


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    """The CPU flash kernels read strides (as for q, k, v, out): no copy of dout unless its last dim is not dense
    (an expanded gradient) -- the copy was one more [s, nq, d] tensor at a recomputed layer's attention backward."""
    return t if t.stride(-1) == 1 else t.contiguous()


class TorchCPUBackend(ByRectangles):
    name = "torch"

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, (lse if q.dtype == torch.float64 else lse.float())

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None):
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _last_dim_dense(dout), q, k, v, out, lse, 0.0, causal, scale=scale)


class MathBackend(ByRectangles):
    """Reference implementation in fp32 (materialises the [sq, sk] scores of one call)."""

    name = "math"

    @staticmethod
    def _expand(t, nq):
        return t.repeat_interleave(nq // t.shape[1], dim=1) if t.shape[1] != nq else t

    def _scores(self, q, k, causal, scale):
        """fp32 scores ``[b, nq, sq, sk]`` (-inf above the diagonal when causal) and the scale used."""
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        s = torch.matmul(q.float(), self._expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
        if causal:
            sq, sk = s.shape[-2:]
            s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        return s, scale

    def _probs(self, q, k, causal, scale):
        s, scale = self._scores(q, k, causal, scale)
        lse = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
        return torch.exp(s - safe), lse, scale

    def _block_probs(self, q, k, lse, causal, scale):
        s, _ = self._scores(q, k, causal, scale)
        lse = lse.float().unsqueeze(-1)
        return torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None):
        p, lse, _ = self._probs(q, k, causal, scale)
        out = torch.matmul(p, self._expand(v, q.shape[1]).float())
        return out.to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None):
        # The probabilities come from the *given* lse (the merged lse over every key block when ring/FPDT call
        # this per block), not from this block's own softmax: P_blk = exp(S_blk - lse_total).
        nq, nkv = q.shape[1], k.shape[1]
        p = self._block_probs(q, k, lse, causal, scale)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        do = dout.float()
        ve = self._expand(v, nq).float()
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, ve.transpose(-1, -2))
        delta = (do * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, self._expand(k, nq).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        if nq != nkv:
            g = nq // nkv
            dk = dk.view(dk.shape[0], nkv, g, *dk.shape[2:]).sum(2)
            dv = dv.view(dv.shape[0], nkv, g, *dv.shape[2:]).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _NoRectangles:
    """A GPU library's adapter without the rectangles of document masks and windows (config/combinations.py refuses
    them with these backends before training); ``masked``: the kernel that takes them instead (``auto``)."""

    masked = None

    def forward_rects(self, q, k, v, rects, scale: Optional[float] = None, acc=None):
        if self.masked is None:
            raise NotImplementedError(f"the {self.name} attention backend takes no document masks or windows")
        return self.masked.forward_rects(q, k, v, rects, scale, acc)

    def backward_rects(self, dout, q, k, v, out, lse, rects, scale: Optional[float] = None, grads=None):
        if self.masked is None:
            raise NotImplementedError(f"the {self.name} attention backend takes no document masks or windows")
        return self.masked.backward_rects(dout, q, k, v, out, lse, rects, scale, grads)


class FlashAttnBackend(_NoRectangles):
    """flash-attn 2 (GPU). Never executed on this project's machines (no GPU); kept to the documented API."""

    name = "flash"

    def __init__(self, masked=None):
        # optional GPU library, imported only when this backend is chosen (ImportError: ``Kernels`` refuses it)
        from flash_attn import flash_attn_interface as fa

        self.fa = fa
        self.masked = masked  # ``auto``: the kernel for rectangles (documents, windows): PyTorch's varlen one

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None):
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # flash-attn wants [b, s, n, d]
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        res = self.fa._flash_attn_forward(qt, kt, vt, 0.0, scale, causal=causal, window_size_left=-1,
                                          window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                          return_softmax=False)
        out, lse = res[0], res[1]
        return out.transpose(1, 2), lse.float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None):
        qt, kt, vt, ot, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        self.fa._flash_attn_backward(dot, qt, kt, vt, ot, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None,
                                     False)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class TEBackend(_NoRectangles):
    """TransformerEngine's fused attention (cuDNN; GPU, fp16/bf16 only). Never executed on this project's machines
    (no GPU, TE not installed): written against TE 2.x ``transformer_engine.pytorch.cpp_extensions.fused_attn``
    (``fused_attn_fwd`` / ``fused_attn_bwd``, bshd layout, the F16_arbitrary_seqlen backend whose first auxiliary
    tensor is the softmax log-sum-exp ``[b, n, sq, 1]``). Its argument lists change between TE releases: check
    them against the installed version before relying on this adapter."""

    name = "te"

    def __init__(self):
        # optional GPU library, imported only when this backend is chosen (ImportError: ``Kernels`` refuses it)
        from transformer_engine.pytorch.constants import TE_DType
        from transformer_engine.pytorch.cpp_extensions import fused_attn as tefa

        self.tefa, self.TE_DType = tefa, TE_DType

    @staticmethod
    def _cu(b, s, device):
        return torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=device)

    def forward(self, q, k, v, causal: bool, scale: Optional[float] = None):
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [b, s, n, d]
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        out, aux = self.tefa.fused_attn_fwd(
            True, sq, sk, self._cu(b, sq, q.device), self._cu(b, sk, q.device), qt, kt, vt, q.dtype,
            self.tefa.FusedAttnBackend["F16_arbitrary_seqlen"], attn_scale=scale, dropout=0.0,
            qkv_layout="bshd_bshd_bshd", attn_mask_type="causal" if causal else "no_mask")
        return out.transpose(1, 2), aux[0].squeeze(-1).float()

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float] = None):
        qt, kt, vt, ot, dot = (t.transpose(1, 2).contiguous() for t in (q, k, v, out, dout))
        b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # dropout is 0: the state is not read
        dq, dk, dv = self.tefa.fused_attn_bwd(
            sq, sk, self._cu(b, sq, q.device), self._cu(b, sk, q.device), qt, kt, vt, ot, dot, q.dtype,
            self.TE_DType[q.dtype], [lse.unsqueeze(-1).contiguous(), rng_state],
            self.tefa.FusedAttnBackend["F16_arbitrary_seqlen"], attn_scale=scale, dropout=0.0,
            qkv_layout="bshd_bshd_bshd", attn_mask_type="causal" if causal else "no_mask")[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class Kernels:
    """The local kernel named by ``parallel.attention_backend``, one instance per device type, for every module that
    calls kernels (local, ring, Ulysses' inner attention, FPDT's chunks). A named backend this process cannot run (a
    package not installed, a GPU of another generation) is one ``ConfigError`` line when the model is built, not an
    ImportError at the first forward; ``auto`` skips such backends silently. ``device_type`` (a rehearsal: kernels
    chosen for a device the process does not run on) builds cuDNN's and FlashAttention-3 / 4's adapters for their
    aten ops' shape functions, without their packages."""

    def __init__(self, name: str = "auto", device_type: Optional[str] = None):
        self.name, self.device_type = name, device_type  # device_type: chooses for every device (a rehearsal)
        if name not in NAMES:
            raise ConfigError(f"unknown parallel.attention_backend {name!r}; valid: {', '.join(NAMES)}")
        why = None if device_type is not None and name in REGISTRY_OPS else missing(name)
        if why is not None:
            raise ConfigError(f"parallel.attention_backend {name} {why}; use auto or torch")
        self._by_device: dict = {}

    def __call__(self, device: torch.device):
        """The kernel for ``device`` (``auto``: the fastest measured on this GPU, ``kernel_table.py``; the CPU's
        fused kernel on CPU)."""
        kind = self.device_type or device.type
        if kind == "cpu" and self.name in CUDA_ONLY:  # train.device auto on a machine without a GPU
            raise ConfigError(f"parallel.attention_backend {self.name} runs on CUDA only, and this run's device is "
                              f"the CPU; use auto, torch or math")
        if kind not in self._by_device:
            real = device if self.device_type is None else None
            self._by_device[kind] = get_backend(self.name, torch.device(kind), real_device=real)
        return self._by_device[kind]

    @staticmethod
    def of(backend) -> "Kernels":
        """``backend``: a ``Kernels`` (the model's) or a ``parallel.attention_backend`` name."""
        return backend if isinstance(backend, Kernels) else Kernels(backend)


NAMES = ("auto", "torch", "cudnn", "fa3", "fa4", "math", "flash", "te")
REGISTRY_OPS = ("cudnn", "fa3", "fa4")  # reached through aten ops: shape functions without a GPU or a package
LIBRARIES = {"flash": "flash_attn", "te": "transformer_engine"}


def missing(name: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why backend ``name`` cannot run in this process (None: it can; auto, torch and math always can)."""
    if name in REGISTRY_OPS:
        return unavailable(name, device)
    if name in LIBRARIES:
        try:
            get_backend(name, torch.device("cuda"))
        except ImportError as e:
            return f"needs a package that is not installed ({e})"
    return None


def get_backend(name: str = "auto", device: Optional[torch.device] = None,
                real_device: Optional[torch.device] = None):
    """``auto``: on CUDA the backend ``auto_choice`` names, on CPU PyTorch's CPU flash kernel. ``torch``: PyTorch's
    fused kernel of the device. ``math`` only when named. ``real_device``: the GPU the kernels run on (None: a
    rehearsal or a test, which gets the aten ops without activating any package)."""
    dev = device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    named = name != "auto"
    if name == "auto":
        if dev != "cuda":
            return TorchCPUBackend()
        name = auto_choice(str(real_device) if real_device is not None else None)
        if name == "flash":
            return FlashAttnBackend(masked=TorchCUDABackend())  # rectangles: PyTorch's varlen kernel
    if name == "torch":
        return TorchCUDABackend() if dev == "cuda" else TorchCPUBackend()
    if name == "math":
        return MathBackend()
    if name == "cudnn":  # (a head dim cuDNN refuses: one line when named, the torch kernel under auto)
        return CudnnBackend(named=named, device=real_device)
    if name in ("fa3", "fa4"):
        return RegisteredFlashBackend(name, activate=real_device is not None)
    if name == "flash":
        return FlashAttnBackend()
    if name == "te":
        return TEBackend()
    raise ValueError(f"unknown attention backend {name!r} ({', '.join(NAMES)})")


@functools.lru_cache(maxsize=None)
def auto_choice(device: Optional[str]) -> str:
    """``auto`` on a GPU (once per process and device): the fastest backend of the table measured on this GPU, else
    on its generation (``kernel_table.table_for_gpu``), among those this process can run; ``torch`` without a table
    or without a real GPU (a rehearsal). Said once in the log, with the table's GPU and date."""
    if device is None or not torch.cuda.is_available():
        return "torch"
    dev = torch.device(device)
    gpu, cap = torch.cuda.get_device_name(dev), ".".join(map(str, torch.cuda.get_device_capability(dev)))
    table = table_for_gpu(gpu, cap)
    if table is None:
        log.info("attention_backend auto: torch (no attention table measured on %s or its generation in "
                 "configs/hardware; bench/attention_kernels.py writes one)", gpu)
        return "torch"
    runnable = [b for b in table.backends if b != "math" and missing(b, dev) is None]
    pick = table.fastest(runnable) or "torch"
    log.info("attention_backend auto: %s, the fastest of %s as %s measured them", pick, ", ".join(runnable) or "none",
             table.source)
    return pick
