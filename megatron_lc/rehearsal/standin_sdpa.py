"""``F.scaled_dot_product_attention`` on the stand-in device picks the kernel CUDA's picks. PyTorch chooses SDPA's
kernel per device (CUDA: ``select_sdp_backend`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``); a
PrivateUse1 device has no choice registered and always gets the math kernel (an s x s score matrix per head), which
a GPU run does not. This registers SDPA for the stand-in at ``AutogradPrivateUse1`` with CUDA's order for the
dense inputs a model passes: flash attention when it can (fp16 / bf16, head dim <= 256, no mask; fewer kv heads
allowed), else the memory-efficient kernel (no fewer kv heads; a mask as an additive bias, its rows padded to 16
elements as SDPA pads them), else math. Example: bf16 q ``[1, 32, s, 128]`` with k, v ``[1, 8, s, 128]`` -> flash;
the same in fp32 -> math (the efficient kernel takes no GQA); fp32 without GQA -> memory-efficient.

Not modelled: cuDNN attention (off by default), nested tensors, dropout's RNG state, the head-dim padding to a
multiple of 8 flash does for odd sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

aten = torch.ops.aten
_LIBRARIES: list = []  # the registration lives as long as this object

FLASH_DTYPES = (torch.float16, torch.bfloat16)
BIAS_ALIGN = 16  # SDPA pads a mask's last dim to a multiple of this for the memory-efficient kernel


def choice(q: torch.Tensor, k: torch.Tensor, attn_mask) -> str:
    """``flash`` | ``efficient`` | ``math``: CUDA's first kernel whose constraints these inputs meet."""
    if attn_mask is None and q.dtype in FLASH_DTYPES and q.shape[-1] <= 256:
        return "flash"
    if k.shape[-3] == q.shape[-3] and q.dtype in (torch.float32, *FLASH_DTYPES):
        return "efficient"
    return "math"


def _bias(mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the additive bias SDPA hands the memory-efficient kernel (its last dim padded to 16)."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    sk = mask.shape[-1]
    if sk % BIAS_ALIGN:
        mask = F.pad(mask, (0, BIAS_ALIGN - sk % BIAS_ALIGN))[..., :sk]
    return mask


def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                                 enable_gqa=False):
    kind = choice(q, k, attn_mask)
    if kind == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[0]
    if kind == "efficient":
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        bias = None if attn_mask is None else _bias(attn_mask, q)
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, lse, dropout_p, is_causal,
                                                            scale=scale)[0]
    return aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                   enable_gqa=enable_gqa)[0]


def install_sdpa() -> None:
    """Once per process (``standin.install``)."""
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("scaled_dot_product_attention", scaled_dot_product_attention, "AutogradPrivateUse1")
    _LIBRARIES.append(lib)
