"""Hopper-class attention kernels behind the (out, lse) interface of ``backends.py``: cuDNN's fused attention, in
every CUDA build of PyTorch, and FlashAttention-3 / 4, to which PyTorch's registry routes its flash kernel when their
packages are installed. Both subclass ``fused_cuda.TorchCUDABackend`` and replace only its bf16 / fp16 dense kernel:

* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)`` -> out (q's memory
  layout), lse ``[b, nq, sq, 1]`` fp32 (handed on as a ``[b, nq, sq]`` view); its backward takes the lse it is
  given (the merged one of ring / FPDT blocks, unsqueezed: a view). GQA native: k, v keep their kv heads (PyTorch
  >= 2.8 lets SDPA send fewer kv heads to cuDNN) and dk, dv come back at them. The backward's graph is built with
  q's, k's and v's strides for dQ, dK, dV and q's layout for O and dO, and checked against the tensors it is given
  (aten/src/ATen/native/cudnn/MHA.cpp: ``build_graph_backward`` sets ``Dv->set_stride(v.strides())``,
  ``run_cudnn_SDP_bprop`` ``check_tensor_matches_graph(mha_graph, DV, dV)``, a ``TORCH_CHECK``), while
  ``_cudnn_attention_backward`` allocates ``dv = at::empty_like(value)`` -- dense whatever v's gaps: a v that is a
  gapped view of the fused QKV output fails at the first backward. So the backward hands it dense q, k, v
  (``dense``: a copy only of a gapped view) and out, dout in q's layout (``in_layout``). Head dims above 128 need
  cuDNN >= 9.10 on compute capability 9.0 (``check_cudnn_tensor_shapes`` in sdp_utils.cpp, which a direct op call
  skips: ``cudnn_head_dim_refusal`` mirrors it).
* ``fa3`` / ``fa4``: ``torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")``, once per process (an
  override of ``aten._scaled_dot_product_flash_attention``, its backward and ``aten._flash_attention_forward`` /
  ``_backward`` on CUDA), then the same aten calls as the ``torch`` backend without repeating k, v: the registry's
  wrappers hand the kernels ``[b, s, n, d]`` views of our ``[b, n, s, d]`` views (a dense last dim is all they need)
  and take fewer kv heads. The variable-length op of documents and windows (``torch_attn::_varlen_attn``) calls
  ``aten._flash_attention_forward``, so the rectangles run on FlashAttention-3 / 4 as well.

No layout copies in the forwards and in FlashAttention-3 / 4's backward: q, k, v, out and dout are the strided
``[b, n, s, d]`` views the cores pass (``core.to_bnsd``); the kernels read strides.
fp32 (no low-precision kernel takes it) and head dims above 256 fall back to ``TorchCUDABackend``'s memory-efficient
path (k, v repeated to the query heads for the call); rectangles use its variable-length packing.

``unavailable(name)`` says in one line why a backend cannot run in this process (a package not installed, a GPU of
another generation, a torch without the op); ``Kernels`` turns that into a ``ConfigError`` when the backend is named
and skips the backend silently under ``auto``. Never executed on this project's CPU machines: the wrapping is tested
with CPU stand-ins of the ops (tests/attention/test_hopper_backends.py), the shapes under fake tensors by the
rehearsal; ``bench/attention_kernels.py`` and ``tests/gpu`` T1 run the kernels on a GPU.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch
import torch.nn.attention as sdpa_registry

from ..config import ConfigError
from .fused_cuda import TorchCUDABackend, rng_placeholders

# backend -> (the module PyTorch's registry imports, its registry name, the pip package, GPU generations)
REGISTERED = {"fa3": ("flash_attn_interface", "FA3", "FlashAttention-3 (built from flash-attention's hopper/)", (9,)),
              "fa4": ("flash_attn.cute.interface", "FA4", "flash-attn-4", (9, 10))}
CUDNN_MIN = 8900  # cuDNN 8.9.0: the first with the fused attention graphs PyTorch builds
CUDNN_HEAD_256 = 91000  # cuDNN 9.10.0: head dims 129-256 on compute capability 9.0 (sdp_utils.cpp)


def _has_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # a parent package is missing (flash_attn without cute)
        return False


def _capability(device: Optional[torch.device]) -> Optional[tuple]:
    """The GPU's compute capability, or None where no real CUDA device is (a CPU machine, a rehearsal)."""
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def unavailable(name: str, device: Optional[torch.device] = None) -> Optional[str]:
    """Why backend ``name`` (cudnn, fa3, fa4) cannot run here, as "needs ..."; None when it can. Without a GPU
    only what the process has is checked (the op, the package): the generation is checked on the GPU itself."""
    cap = _capability(device)
    if name == "cudnn":
        if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
            return f"needs a torch with the cuDNN attention op (torch {torch.__version__} has none)"
        if cap is None:
            return None
        if not torch.backends.cudnn.is_available() or (torch.backends.cudnn.version() or 0) < CUDNN_MIN:
            return f"needs cuDNN >= 8.9 (this torch has {torch.backends.cudnn.version()})"
        return None if cap[0] >= 8 else f"needs compute capability 8.0 or later (this GPU: {cap})"
    module, impl, package, majors = REGISTERED[name]
    if not _has_module(module):
        return f"needs {package}, which is not installed (module {module})"
    listed = getattr(sdpa_registry, "list_flash_attention_impls", None)  # (a torch before the registry: none)
    if listed is None or impl not in listed():
        return f"needs torch.nn.attention's {impl} registry entry (torch {torch.__version__} has none)"
    if cap is not None and cap[0] not in majors:
        return f"needs compute capability {' or '.join(f'{m}.x' for m in majors)} (this GPU: {cap})"
    return None


def cudnn_head_dim_refusal(head_dim: int, cap: Optional[tuple], cudnn: Optional[int]) -> Optional[str]:
    """Why cuDNN's fused attention takes no head dim ``head_dim`` on a GPU of compute capability ``cap`` with cuDNN
    ``cudnn`` (``torch.backends.cudnn.version()``), as SDPA's ``check_cudnn_tensor_shapes`` says (sdp_utils.cpp:
    ``head_dim_limit = 128``, 256 ``if (cudnn_version >= 91000)`` and ``dprops->major == 9 && !dprops->minor``; a
    multiple of 8); None when it takes it or nothing is known (no GPU: a rehearsal)."""
    if head_dim % 8:
        return f"head dim {head_dim} is not a multiple of 8"
    if head_dim <= 128 or cap is None:
        return None
    if head_dim > 256:
        return f"head dim {head_dim} is above cuDNN's 256"
    if cap != (9, 0) or (cudnn or 0) < CUDNN_HEAD_256:
        return (f"head dim {head_dim} needs cuDNN >= 9.10 on compute capability 9.0 (this: cuDNN {cudnn}, "
                f"capability {cap[0]}.{cap[1]})")
    return None


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` if its elements fill its storage range without gaps (any dim order), else a dense copy in the same dim
    order: what ``empty_like(t)`` gives dQ / dK / dV then has ``t``'s strides, and out / dout, which the cores keep
    in that order (the forward's out has q's layout), need no copy. Example: q a ``[b, n, s, d]`` view of the QKV
    output's ``[s, b, n + 2 nkv, d]`` -> a ``[s, b, n, d]`` tensor, viewed ``[b, n, s, d]``."""
    order = sorted(range(t.dim()), key=lambda i: (t.stride(i), -i))  # innermost first
    step = 1
    for i in order:
        if t.shape[i] != 1 and t.stride(i) != step:
            outer = order[::-1]
            return t.permute(outer).contiguous().permute([outer.index(i) for i in range(t.dim())])
        step *= t.shape[i]
    return t


def in_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` with ``like``'s strides (a copy only when they differ): cuDNN's backward graph takes O and dO in q's
    layout."""
    if t.stride() == like.stride():
        return t
    return torch.empty_like(like).copy_(t)


class CudnnBackend(TorchCUDABackend):
    """cuDNN's fused attention for bf16 / fp16 (module doc). ``named``: the backend was asked for by name (a head dim
    cuDNN refuses is then one ``ConfigError`` line); under ``auto`` such a head dim runs the ``torch`` flash kernel."""

    name = "cudnn"

    def __init__(self, ops=None, varlen=None, named: bool = True, device: Optional[torch.device] = None):
        super().__init__(ops, varlen)
        self.named, self.device = named, device
        self._refusal: dict = {}

    def refused(self, head_dim: int) -> Optional[str]:
        """``cudnn_head_dim_refusal`` for this process's GPU (once per head dim)."""
        if head_dim not in self._refusal:
            cap = _capability(self.device or (torch.device("cuda") if torch.cuda.is_available() else None))
            self._refusal[head_dim] = cudnn_head_dim_refusal(
                head_dim, cap, torch.backends.cudnn.version() if cap is not None else None)
        why = self._refusal[head_dim]
        if why is not None and self.named:
            raise ConfigError(f"parallel.attention_backend cudnn: {why}; use auto or torch")
        return why

    def _low_precision_forward(self, q, k, v, causal: bool, scale: Optional[float]):
        if self.refused(q.shape[-1]):
            return super()._low_precision_forward(q, k, v, causal, scale)
        res = self.ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].squeeze(-1)  # lse [b, nq, sq, 1] -> [b, nq, sq] (a view)

    def _low_precision_backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float]):
        if self.refused(q.shape[-1]):
            return super()._low_precision_backward(dout, q, k, v, out, lse, causal, scale)
        q, k, v = dense(q), dense(k), dense(v)  # dQ, dK, dV are empty_like of these: their strides must match
        return tuple(self.ops._scaled_dot_product_cudnn_attention_backward(
            in_layout(dout, q), q, k, v, in_layout(out, q), lse.unsqueeze(-1), *rng_placeholders(q, flash=False),
            None, None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale))


class RegisteredFlashBackend(TorchCUDABackend):
    """FlashAttention-3 / 4 through PyTorch's registry (module doc). ``activate``: route aten's flash kernels to
    the package now (process-wide); False for a rehearsal, which runs the same aten ops' shape functions."""

    def __init__(self, name: str, ops=None, varlen=None, activate: bool = True):
        super().__init__(ops, varlen)
        self.name = name
        impl = REGISTERED[name][1]
        if activate and sdpa_registry.current_flash_attention_impl() != impl:
            sdpa_registry.activate_flash_attention_impl(impl)

    def _low_precision_forward(self, q, k, v, causal: bool, scale: Optional[float]):
        res = self.ops._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()

    def _low_precision_backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float]):
        return tuple(self.ops._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, *rng_placeholders(q),
            scale=scale))
