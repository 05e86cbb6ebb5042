"""The rehearsal's stand-in accelerator: a device of its own, ``standin:0``, distinct from the host (``cpu``), on
which the step's fake tensors live. PyTorch's PrivateUse1 backend renamed (``torch.utils.rename_privateuse1_backend``),
with a Python device guard and hooks (autograd asks the device guard for streams) and a device module
(``torch.standin``: FSDP2 and the device mesh ask it for streams and events). Fake tensors dispatch on it as on the
CPU -- every op runs through its shape function -- but a fake tensor keeps its device, so an op that mixes a host
tensor with a device tensor is seen as CUDA would see it (``mix_check.DeviceMixCheck`` reports it with its site)::

    device = install()                         # once per process: standin:0
    with FakeTensorMode():
        x = torch.empty(4, 8, device=device)
        x + torch.empty(8)                     # FakeTensorDeviceMismatchError, as CUDA's "found cuda:0 and cpu"
        with torch.autocast(device.type, dtype=torch.bfloat16):
            (x @ x.t()).dtype                  # torch.bfloat16: CUDA's autocast rules (standin_autocast.py)
        # F.scaled_dot_product_attention: the kernel CUDA would pick (standin_sdpa.py)

What the stand-in does not have: values (fake tensors), CUDA's caching allocator, kernels' own workspaces, real
streams (its streams are names: the order is checked by ``device.StreamCheck``), pinned memory (``pin_memory`` is
refused on it, as FSDP2's CPU offload is asked not to pin).

Installing is for the life of the process (PyTorch renames its PrivateUse1 backend once): a rehearsal runs each
rank in a process of its own.
"""
from __future__ import annotations

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from .standin_autocast import install_autocast
from .standin_sdpa import install_sdpa

NAME = "standin"


class _Module:
    """``torch.standin``: what PyTorch, FSDP2 and the device mesh ask a device's module (one device, index 0;
    streams and events are the CPU's stand-ins: names that synchronise nothing)."""

    Stream = torch.cpu.Stream
    Event = torch.cpu.Event

    @staticmethod
    def is_available() -> bool:
        """False: nothing real can be made on the stand-in, so ``FakeTensorMode`` never materialises a constant
        on it (its ``avoid_device_init``) -- a constant moved there becomes a fake tensor, as every other."""
        return False

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed(seed: int) -> None:
        pass

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        pass

    @staticmethod
    def get_amp_supported_dtype() -> list:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def current_stream(device=None):
        return torch.cpu.current_stream()

    @staticmethod
    def stream(stream):
        return torch.cpu.stream(stream)

    @staticmethod
    def synchronize(device=None) -> None:
        pass


def installed() -> bool:
    return torch._C._get_privateuse1_backend_name() == NAME


def install() -> torch.device:
    """Register the stand-in device in this process (again: nothing to do); returns ``standin:0``."""
    if not installed():
        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
        install_autocast()
        install_sdpa()
    return torch.device(NAME, 0)
