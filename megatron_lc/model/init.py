"""Layout-independent initialisation: each parameter's *full* tensor is drawn from a generator seeded by
(seed, parameter name), then this rank's tp shard is cut from it (an MoE layer's experts: this expert rank's
experts, ``parallel/expert_parallel.py``) -- and, for a parameter FSDP2 has sharded, this
rank's dp x cp shard of that (``torch.chunk`` along its shard dim, FSDP2's cut). So the same seed gives the same
full model for any tp / cp / dp, and loss curves of different layouts match step by step.

``materialize``: a model built on the meta device and sharded there gets storage for its own shards only, then
their values. Example, Llama-3.1-70B on 32 ranks (FSDP2 over cp 32, its CPU offload): each rank's host holds its
2.2B parameters' fp32 shards (8.2 GiB) and, while it draws one, one full tensor (at most the 4 GiB embedding) --
not the whole model's 263 GiB, eight times on a node of eight ranks."""
from __future__ import annotations

import zlib

import torch
from torch import nn

from ..parallel.expert_parallel import expert_full_shape, expert_shard
from ..parallel.fsdp import is_sharded, local
from ..parallel.tensor_parallel import full_shape, shard_full_tensor
from ..parallel.topology import Topology
from .rope import RotaryEmbedding


def param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def _fsdp_shard(piece: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's FSDP2 shard of ``piece`` (``p``'s full tp-local tensor) when ``p`` is a DTensor sharded over a
    1-D mesh (``parallel/fsdp.py``), else ``piece``: chunk ``mesh rank`` of ``torch.chunk`` along the shard dim."""
    if not is_sharded(p):
        return piece
    (placement,) = p.placements
    chunks = torch.chunk(piece, p.device_mesh.size(), placement.dim)
    rank = p.device_mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else piece.narrow(placement.dim, 0, 0)


@torch.no_grad()
def init_model(model: nn.Module, seed: int, topo: Topology) -> None:
    for name, p in model.named_parameters():
        kind = getattr(p, "init", ("normal", 0.02))
        shape = expert_full_shape(p, full_shape(p, topo.tp), topo)  # an MoE layer's: every expert
        if kind[0] == "ones":
            full = torch.ones(shape)
        elif kind[0] == "zeros":
            full = torch.zeros(shape)
        else:
            g = torch.Generator().manual_seed(param_seed(seed, name))
            full = torch.empty(shape).normal_(0.0, kind[1], generator=g)
        mine = local(p)
        piece = expert_shard(shard_full_tensor(full, p, topo), p, topo)
        mine.copy_(_fsdp_shard(piece, p).to(mine.device, mine.dtype))


def materialize(model: nn.Module, seed: int, topo: Topology, device: torch.device,
                buffer_device: torch.device) -> None:
    """``model``, built on the meta device (and sharded there by FSDP2), on ``device``: storage for this rank's
    parameters (their shards), their values (``init_model``), the buffers recomputed on ``buffer_device`` (the
    run's device; ``device`` is the host with FSDP2's CPU offload)."""
    # (``to_empty`` makes new parameters: our attributes -- tp partition, SP, init -- carried over, DTensor's own not)
    attrs = {n: {k: v for k, v in vars(p).items() if not k.startswith("_")} for n, p in model.named_parameters()}
    model.to_empty(device=device)
    for n, p in model.named_parameters():
        for k, v in attrs[n].items():
            setattr(p, k, v)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.init_buffers(buffer_device)
    init_model(model, seed, topo)
