"""Hopper-class attention kernels behind the (out, lse) interface of ``backends.py``: cuDNN's fused attention, in
every CUDA build of PyTorch, and FlashAttention-3 / 4, to which PyTorch's registry routes its flash kernel when their
packages are installed. Both subclass ``fused_cuda.TorchCUDABackend`` and replace only its bf16 / fp16 dense kernel:

* ``cudnn``: ``aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)`` -> out (q's memory
  layout), lse ``[b, nq, sq, 1]`` fp32 (handed on as a ``[b, nq, sq]`` view); its backward takes the lse it is
  given (the merged one of ring / FPDT blocks, unsqueezed: a view). GQA native: k, v keep their kv heads (PyTorch
  >= 2.8 lets SDPA send fewer kv heads to cuDNN) and dk, dv come back at them.
* ``fa3`` / ``fa4``: ``torch.nn.attention.activate_flash_attention_impl("FA3" | "FA4")``, once per process (an
  override of ``aten._scaled_dot_product_flash_attention``, its backward and ``aten._flash_attention_forward`` /
  ``_backward`` on CUDA), then the same aten calls as the ``torch`` backend without repeating k, v: the registry's
  wrappers hand the kernels ``[b, s, n, d]`` views of our ``[b, n, s, d]`` views (a dense last dim is all they need)
  and take fewer kv heads. The variable-length op of documents and windows (``torch_attn::_varlen_attn``) calls
  ``aten._flash_attention_forward``, so the rectangles run on FlashAttention-3 / 4 as well.

No layout copies: q, k, v, out and dout are the strided ``[b, n, s, d]`` views the cores pass (``core.to_bnsd``); the
kernels read strides (cuDNN permutes dout to out's layout only when their strides differ, which ours never do).
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

from .fused_cuda import TorchCUDABackend, no_rng

# backend -> (the module PyTorch's registry imports, its registry name, the pip package, GPU generations)
REGISTERED = {"fa3": ("flash_attn_interface", "FA3", "FlashAttention-3 (built from flash-attention's hopper/)", (9,)),
              "fa4": ("flash_attn.cute.interface", "FA4", "flash-attn-4", (9, 10))}
CUDNN_MIN = 8900  # cuDNN 8.9.0: the first with the fused attention graphs PyTorch builds


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
    if impl not in sdpa_registry.list_flash_attention_impls():
        return f"needs torch.nn.attention's {impl} registry entry (torch {torch.__version__} has none)"
    if cap is not None and cap[0] not in majors:
        return f"needs compute capability {' or '.join(f'{m}.x' for m in majors)} (this GPU: {cap})"
    return None


class CudnnBackend(TorchCUDABackend):
    """cuDNN's fused attention for bf16 / fp16 (module doc)."""

    name = "cudnn"

    def _low_precision_forward(self, q, k, v, causal: bool, scale: Optional[float]):
        res = self.ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return res[0], res[1].squeeze(-1)  # lse [b, nq, sq, 1] -> [b, nq, sq] (a view)

    def _low_precision_backward(self, dout, q, k, v, out, lse, causal: bool, scale: Optional[float]):
        return tuple(self.ops._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), *no_rng(q), None, None, None, q.shape[2], k.shape[2], 0.0,
            causal, scale=scale))


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
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, *no_rng(q), scale=scale))
