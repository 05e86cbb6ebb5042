"""Layout-independent initialisation: each parameter's *full* tensor is drawn from a generator seeded by
(seed, parameter name), then this rank's tp shard is cut from it. So the same seed gives the same full model for
any tp / cp / dp, and loss curves of different layouts match step by step."""
from __future__ import annotations

import zlib

import torch
from torch import nn

from ..parallel.tensor_parallel import full_shape, shard_full_tensor
from ..parallel.topology import Topology


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def init_model(model: nn.Module, seed: int, topo: Topology) -> None:
    for name, p in model.named_parameters():
        kind = getattr(p, "init", ("normal", 0.02))
        shape = full_shape(p, topo.tp)
        if kind[0] == "ones":
            full = torch.ones(shape)
        elif kind[0] == "zeros":
            full = torch.zeros(shape)
        else:
            g = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(shape).normal_(0.0, kind[1], generator=g)
        p.copy_(shard_full_tensor(full, p, topo).to(p.device, p.dtype))
