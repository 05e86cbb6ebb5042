"""Memo's job profiler (§4.3.2), the part that feeds alpha: measured on the running machine, per rank, before
training.

* skeletal sizes of one layer (input, attention output + lse, others): one forward of layer 0 on a synthetic input
  of the training shape, every saved tensor counted by storage (``SkeletalSlot`` in measure mode);
* ``t_layer``: median wall time of that layer's forward with autograd on (as in training);
* device <-> host bandwidth: median of copies of a buffer of the layer's skeletal size (capped) into a host
  tensor from ``DeviceAdapter.host_empty`` (pinned on CUDA) and back;
* host memory: ``memory.host_memory_gb`` (a node's budget) or, by default, ``MemAvailable`` of /proc/meminfo,
  shared by the ranks on this node (counted by hostname).

Like the paper we profile one layer and apply it to all (the layers are identical).
"""
from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..device import DeviceAdapter

GIB = float(2 ** 30)


@dataclass
class LayerProfile:
    s_input: int
    s_attn: int  # attention output + lse
    s_lse: int
    s_others: int
    t_layer: float
    bw_d2h: float
    bw_h2d: float
    host_node_bytes: float
    ranks_per_node: int
    host_source: str  # "config" | "MemAvailable"
    tokens: int  # S, local tokens of the layer input

    @property
    def host_budget(self) -> float:
        return self.host_node_bytes / self.ranks_per_node

    def as_dict(self) -> dict:
        d = asdict(self)
        d["host_budget"] = self.host_budget
        return d


def available_host_bytes() -> float:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def ranks_on_this_node() -> int:
    """How many ranks of the job share this host (1 without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return names.count(socket.gethostname())


def host_budget(host_memory_gb) -> tuple[float, str]:
    if host_memory_gb is not None:
        return float(host_memory_gb) * GIB, "config"
    return available_host_bytes(), "MemAvailable"


def _timed(fn, dev: DeviceAdapter, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        dev.synchronize()
        t0 = time.perf_counter()
        fn()
        dev.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(nbytes: int, device: torch.device, repeats: int = 3) -> tuple[float, float]:
    """(device->host, host->device) bytes per second for a copy of ``nbytes``."""
    dev = DeviceAdapter.for_device(device)
    nbytes = max(int(nbytes), 32 << 20)  # small copies measure thread wake-ups, not bandwidth
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host = dev.host_empty((nbytes,), torch.uint8)
    host.copy_(src)  # warm-up (first-touch of the host pages)
    d2h = _timed(lambda: host.copy_(src, non_blocking=True), dev, repeats)
    h2d = _timed(lambda: src.copy_(host, non_blocking=True), dev, repeats)
    return nbytes / max(d2h, 1e-9), nbytes / max(h2d, 1e-9)


def synthetic_input(model, layer, cfg, topo, device):
    """x ``[S, b, h]`` (requires grad) and the RoPE tables for this rank's training shape."""
    S = cfg.data.seq_length // topo.cp
    sp = cfg.parallel.sequence_parallel and topo.tp > 1
    b = cfg.train.micro_batch_size
    g = torch.Generator(device="cpu").manual_seed(1234)
    x = torch.randn(S // topo.tp if sp else S, b, cfg.model.hidden_size, generator=g).to(device)
    x.requires_grad_(True)
    rope = None
    if model.rotary is not None:
        pos = torch.arange(S, device=device).unsqueeze(1).expand(S, b)
        rope = model.rotary(pos)
    return x, rope


def skeletal_sizes(layer, x, rope, io, sp_groups: int) -> dict:
    """Bytes by kind of one layer's skeletal tensors (alpha = 1: every token kept), measured by storage."""
    from .offload import MemoRuntime
    from .executor import MemoExecutor

    rt = MemoRuntime(num_layers=3, alpha=1.0, offload=True, device=x.device, measure=True)
    ex = MemoExecutor(rt, io, sp_groups)
    with torch.enable_grad():
        ex(layer, x, rope)
    return dict(rt.slots[layer.layer_number].stats.bytes)


def profile_layer(model, cfg, topo, io, sp_groups: int, device: torch.device, timing: bool = True,
                  repeats: int = 3) -> LayerProfile:
    """Profile layer 0 of ``model`` on ``device`` for this rank's training shape (every rank must call this:
    the layer's tp / cp collectives run)."""
    layer = model.layers[0]
    x, rope = synthetic_input(model, layer, cfg, topo, device)
    sizes = skeletal_sizes(layer, x, rope, io, sp_groups)
    t_layer = bw_d2h = bw_h2d = float("nan")
    if timing:
        dev = DeviceAdapter.for_device(device)
        saved_executor, layer.executor = layer.executor, None
        try:
            with torch.enable_grad():
                layer(x, rope)  # warm-up
                t_layer = _timed(lambda: layer(x, rope), dev, repeats)
        finally:
            layer.executor = saved_executor
        bw_d2h, bw_h2d = bandwidth(min(sum(sizes.values()), 256 << 20), device, repeats)
    node_bytes, source = host_budget(cfg.memory.host_memory_gb)
    return LayerProfile(s_input=sizes["input"], s_attn=sizes["attn"] + sizes["lse"], s_lse=sizes["lse"],
                        s_others=sizes["other"], t_layer=t_layer, bw_d2h=bw_d2h, bw_h2d=bw_h2d,
                        host_node_bytes=node_bytes, ranks_per_node=ranks_on_this_node(), host_source=source,
                        tokens=x.shape[0])
