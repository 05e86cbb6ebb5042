"""How a run computes, decided once next to the device choice: the device, the autocast dtype (so the compute
dtype) and the residual stream's dtype. The build, the technique runtimes, FSDP2's mixed precision, the metrics'
peak and the estimator's byte sizes all read this one description; nothing else asks "is this run bf16?".

    resolve_execution(cfg, torch.device("cuda", 0))   # train.bf16: autocast bf16, residual fp32 (Megatron's
                                                      # fp32_residual_connection) or bf16 with it false
    resolve_execution(cfg, torch.device("cpu"))       # fp32 throughout: the CPU trains without autocast
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Execution:
    """The device and the dtypes of a run (see module doc)."""

    device: torch.device
    autocast_dtype: Optional[torch.dtype] = None  # bf16 with train.bf16 on an accelerator; None: no autocast
    residual_dtype: torch.dtype = torch.float32  # the residual stream between layers (every layer input)
    # the device type whose attention kernels run: None, the tensors' own; a rehearsal's stand-in device names the
    # accelerator it stands in for ("cuda": PyTorch's fused CUDA kernels, through their shape functions)
    kernel_device: Optional[str] = None
    # where the model is built: False, on the host (then FSDP2's shards or ``model.to`` move it); True, on ``device``
    # itself -- a rehearsal's stand-in device, because PyTorch cannot move a fake tensor in place (``p.data = ...``,
    # as FSDP2 does) between the host and a device of another backend
    build_on_device: bool = False

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the linears, attention and MLP produce."""
        return self.autocast_dtype or torch.float32

    def autocast(self):
        """The training step's autocast context (fp32 master weights), or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def resolve_execution(cfg, device: torch.device) -> Execution:
    """``train.bf16`` autocasts on CUDA only (the CPU trains in fp32); the residual stream is fp32 with
    ``model.fp32_residual_connection``, else the compute dtype."""
    autocast = torch.bfloat16 if cfg.train.bf16 and device.type == "cuda" else None
    compute = autocast or torch.float32
    return Execution(device, autocast, torch.float32 if cfg.model.fp32_residual_connection else compute)
