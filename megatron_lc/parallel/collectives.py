"""Collectives over a topology axis, with byte counters.

Every function takes the ``Topology`` and an ``Axis``; an axis of size 1 is a no-op. Bytes *sent by this rank*
are added to ``topo.comm`` under the current tag (``with topo.comm.tag("layer0.attn"): ...``), so tests and
benchmarks can read what each layer sent. Conventions for "bytes sent" per rank with n ranks and a tensor of B
bytes: all-reduce (ring) 2(n-1)/n*B, all-gather (n-1)*B_local, reduce-scatter (n-1)/n*B_in, all-to-all
(n-1)/n*B, send B.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .topology import Axis, Topology

# torch 2.13 names it reduce_scatter_single (the old name warns it is deprecated); 2.11, the GPU check's torch, has
# only reduce_scatter_tensor -- the same call
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def fake_world() -> bool:
    """torch.distributed runs a fake process group (a rehearsal: ``fake``, or ``cpu:fake,standin:fake`` for the
    host and the stand-in device): collectives return at once, no other rank answers."""
    return (dist.is_available() and dist.is_initialized()
            and all(b.rpartition(":")[2] == "fake" for b in dist.get_backend().split(",")))


def host_backend() -> str:
    """The default group's backend for host tensors: ``gloo`` for ``cpu:gloo,cuda:nccl``, ``fake`` in a rehearsal
    (``gloo`` where the default group names none, e.g. ``nccl``)."""
    for part in dist.get_backend_config().split(","):
        device, _, name = part.rpartition(":")
        if device in ("", "cpu") and name != "nccl":
            return name
    return "gloo"


def all_gather_objects(obj) -> list:
    """``obj`` of every rank of the job, in rank order (``[obj]`` without torch.distributed or with one rank). Under a
    fake process group (a rehearsal: one simulated rank, no other rank to ask) every rank answers as this one."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    if fake_world():
        return [obj] * dist.get_world_size()
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, topo: Topology, axis: Axis, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``axis``; returns ``t``."""
    n = topo.size(axis)
    if n == 1:
        return t
    topo.comm.add("all_reduce", 2 * (n - 1) / n * _nbytes(t))
    dist.all_reduce(t, op=op, group=topo.group(axis))
    return t


def all_gather(t: torch.Tensor, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``t`` along ``dim`` in axis-rank order."""
    n = topo.size(axis)
    if n == 1:
        return t
    topo.comm.add("all_gather", (n - 1) * _nbytes(t))
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t, group=topo.group(axis))
    return torch.cat(parts, dim=dim)


def reduce_scatter(t: torch.Tensor, topo: Topology, axis: Axis, dim: int = 0) -> torch.Tensor:
    """Sum over ranks, then keep this rank's 1/n slice of ``dim``.

    Decided by the tensor's device, not by the group's backend name: the groups of a CUDA run are
    ``cpu:gloo,cuda:nccl`` (``dist.get_backend(group)`` says that, never ``nccl``), and a device tensor goes to the
    device's backend (NCCL; a rehearsal's fake one on its stand-in device) as ``reduce_scatter_tensor`` -- what
    sequence parallelism's backward sends. A host tensor goes to gloo, whose ``reduce_scatter_tensor`` not every
    torch has: an all-reduce, then the slice (the same result; the counter records reduce-scatter's volume either
    way)."""
    n = topo.size(axis)
    if n == 1:
        return t
    if t.shape[dim] % n != 0:
        raise ValueError(f"reduce_scatter: dim {dim} of size {t.shape[dim]} not divisible by {axis.value} size {n}")
    topo.comm.add("reduce_scatter", (n - 1) / n * _nbytes(t))
    group = topo.group(axis)
    if t.device.type != "cpu":
        send = t.movedim(dim, 0).contiguous()  # the pieces along dim 0, one after the other
        out = torch.empty((send.shape[0] // n, *send.shape[1:]), dtype=t.dtype, device=t.device)
        _reduce_scatter(out, send, group=group)
        return out if dim == 0 else out.movedim(0, dim).contiguous()
    t = t.contiguous().clone()
    dist.all_reduce(t, group=group)
    return t.chunk(n, dim=dim)[topo.axis_rank(axis)].contiguous()


def all_to_all(t: torch.Tensor, topo: Topology, axis: Axis, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``t`` into n pieces along ``scatter_dim``, send piece j to rank j, concatenate the received pieces
    along ``gather_dim`` (in axis-rank order). The Ulysses primitive."""
    n = topo.size(axis)
    if n == 1:
        return t
    if t.shape[scatter_dim] % n != 0:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {t.shape[scatter_dim]} not divisible by "
                         f"{axis.value} size {n}")
    topo.comm.add("all_to_all", (n - 1) / n * _nbytes(t))
    send = torch.stack(t.chunk(n, dim=scatter_dim), dim=0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=topo.group(axis))
    return torch.cat(recv.unbind(0), dim=gather_dim)


def all_to_all_v(t: torch.Tensor, send: list, recv: list, topo: Topology, axis: Axis) -> torch.Tensor:
    """Rows ``[send[0] | send[1] | ...]`` of ``t`` to ranks 0, 1, ... of ``axis``; returns the rows received,
    ``recv[j]`` of them from rank j, in axis-rank order (host integers: the split sizes are exchanged first by
    the caller). Bytes sent: the rows that leave this rank."""
    if topo.size(axis) == 1:
        return t
    row = math.prod(t.shape[1:]) * t.element_size()
    topo.comm.add("all_to_all", (sum(send) - send[topo.axis_rank(axis)]) * row)
    out = t.new_empty((sum(recv), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=list(recv), input_split_sizes=list(send),
                           group=topo.group(axis))
    return out


def broadcast(t: torch.Tensor, topo: Topology, axis: Axis, src_axis_rank: int = 0) -> torch.Tensor:
    n = topo.size(axis)
    if n == 1:
        return t
    if topo.axis_rank(axis) == src_axis_rank:
        topo.comm.add("broadcast", _nbytes(t))
    dist.broadcast(t, src=topo.ranks(axis)[src_axis_rank], group=topo.group(axis))
    return t


def count_send(topo: Topology, nbytes: int, op: str = "send") -> None:
    """Record point-to-point bytes sent (ring attention calls this for each isend)."""
    topo.comm.add(op, nbytes)
