"""Memo's calibration, a step of ``training/setup.py`` after the model is built and on its device: the job profiler
(the Memo paper's section 4.3.2), the alpha of the section 4.1 LP (``alpha.py``), the rounding buffers.

The profiler, measured on the running machine, per rank:

* skeletal sizes of one layer (input, attention output + lse, others): one forward of layer 0 on a synthetic input
  of the training shape, every saved tensor counted by storage (``SkeletalSlot`` in measure mode);
* ``t_layer``: median wall time of that layer's forward with autograd on (as in training);
* device <-> host bandwidth: median of copies of a buffer of the layer's skeletal size (capped) into a temporary
  host tensor from ``DeviceAdapter.host_pinned`` (page-locked on CUDA like the host pool, exact size, unlocked and
  freed after the probe: the pool is not allocated yet, its size depends on this calibration) and back;
* host memory: ``memory.host_memory_gb`` (a node's budget) or, by default, ``MemAvailable`` of /proc/meminfo,
  shared by the ranks on this node (counted by hostname).

Like the paper we profile one layer and apply it to all (the layers are identical). Then every rank agrees on the
smallest alpha, and the two rounding buffers are allocated with the exact bytes layer 0 places at that alpha (each
region padded to ``slots.ALIGN``): a buffer never grows during training.

Host memory is the model's ``device.HostPool``, counted exactly: the LP's budget is this rank's share less what the
pool already holds for others (FPDT's parked chunks, ``attention/fpdt/host_share.py``, which runs first) less a bound
on the alignment padding of the swapped layers' copies; after alpha is chosen, Memo reserves one buffer's capacity
per swapped layer and the pool's exact size is checked against the budget (``HostMemoryError`` naming the numbers).
The probes run with the pool in measuring mode (an FPDT block inside the layer parks into plain tensors).
"""
from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from ...device import DeviceAdapter, HostMemoryError, HostPool, host_budget, ranks_on_this_node
from ...model.probe import probe_input
from ...parallel.collectives import all_gather_objects
from ...parallel.fsdp import gathered
from ...units import fmt_bytes
from .alpha import AlphaInputs, check_fixed_alpha, solve_alpha
from .slots import ALIGN

log = logging.getLogger("megatron_lc")


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
    s_padding: int = 0  # bound on the alignment bytes one layer's host copy adds (regions x slots.ALIGN + pool's)

    @property
    def host_budget(self) -> float:
        return self.host_node_bytes / self.ranks_per_node

    def as_dict(self) -> dict:
        d = asdict(self)
        d["host_budget"] = self.host_budget
        return d


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
    host = dev.host_pinned(nbytes)  # temporary: freed (and unlocked) on return
    host.copy_(src)  # warm-up (first-touch of the host pages)
    d2h = _timed(lambda: host.copy_(src, non_blocking=True), dev, repeats)
    h2d = _timed(lambda: src.copy_(host, non_blocking=True), dev, repeats)
    return nbytes / max(d2h, 1e-9), nbytes / max(h2d, 1e-9)


def measure_layer(layer, x, rope, alpha: float):
    """The skeletal slot of one forward of ``layer`` at ``alpha``, measured by storage (nothing copied)."""
    rt = layer.executor.runtime.probe(alpha, x.device)
    with torch.enable_grad():
        layer.executor.with_runtime(rt)(layer, x, rope)
    return rt.slots[layer.layer_number]


def profile_layer(model, layout, device: torch.device, host_memory_gb, dtype: torch.dtype, timing: bool = True,
                  repeats: int = 3) -> tuple:
    """Profile layer 0 of ``model`` on ``device`` for this rank's training shape (every rank must call this:
    the layer's tp / cp collectives run); ``dtype``: the residual stream's, the layer input's. Returns the
    ``LayerProfile`` and the probe it ran on, ``(x, rope)``, for what is measured on the same input after."""
    layer = model.layers[0]
    x, rope = probe_input(model, layout, device, dtype)
    with gathered(layer):
        return _profile_layer(layer, x, rope, device, host_memory_gb, timing, repeats), (x, rope)


def _profile_layer(layer, x, rope, device, host_memory_gb, timing: bool, repeats: int) -> LayerProfile:
    slot = measure_layer(layer, x, rope, alpha=1.0)  # alpha = 1: every token kept
    sizes = dict(slot.stats.bytes)
    t_layer = bw_d2h = bw_h2d = float("nan")
    if timing:
        dev = DeviceAdapter.for_device(device)
        with torch.enable_grad():
            layer.plain_forward(x, rope)  # warm-up
            t_layer = _timed(lambda: layer.plain_forward(x, rope), dev, repeats)
        bw_d2h, bw_h2d = bandwidth(min(sum(sizes.values()), 256 << 20), device, repeats)
    node_bytes, source = host_budget(host_memory_gb)
    return LayerProfile(s_input=sizes["input"], s_attn=sizes["attn"] + sizes["lse"], s_lse=sizes["lse"],
                        s_others=sizes["other"], t_layer=t_layer, bw_d2h=bw_d2h, bw_h2d=bw_h2d,
                        host_node_bytes=node_bytes, ranks_per_node=ranks_on_this_node(), host_source=source,
                        tokens=x.shape[0], s_padding=len(slot.regions) * ALIGN + HostPool.ALIGN)


def calibrate_memo(model, runtime, env) -> None:
    """With offload, profile layer 0 of ``model``, choose alpha (``memory.offload_fraction``: the LP, or the given
    value checked against host memory; the smallest over ranks), size the rounding buffers and the pool's ``memo``
    share (``runtime.size_for``) and log it all. Every rank must call this. ``HostMemoryError`` when even alpha = 0
    does not fit. ``env``: the run's ``compose.Calibration`` -- the layer is profiled and measured under the
    training step's autocast, as it will run (bf16 activations under GPU autocast: half the bytes and a fraction of
    the fp32 time)."""
    if not runtime.offload:
        return
    memory_cfg, layout, topo, device = env.cfg.memory, env.layout, env.topo, env.execution.device
    autocast, pool = env.execution.autocast, runtime.pool
    fixed = None if memory_cfg.offload_fraction == "auto" else float(memory_cfg.offload_fraction)
    with topo.comm.tag("memo.profile"), autocast(), pool.measuring():  # the layer input as the step places it
        prof, (x, rope) = profile_layer(model, layout, device, memory_cfg.host_memory_gb,
                                        env.execution.residual_dtype, timing=fixed is None)
    others = pool.others_than("memo")  # FPDT's parked chunks (reserved before), the checkpoint staging beside the pool
    swapped = sum(runtime.swapped(i) for i in range(runtime.n))
    inp = AlphaInputs(s_input=prof.s_input, s_attn=prof.s_attn, s_others=prof.s_others,
                      bandwidth=prof.bw_d2h if fixed is None else math.inf,
                      t_layer=prof.t_layer if fixed is None else math.inf,
                      num_layers=len(model.layers), host_budget=prof.host_budget - others - swapped * prof.s_padding)
    result, error = None, None
    try:
        result = solve_alpha(inp) if fixed is None else check_fixed_alpha(inp, fixed)
    except HostMemoryError as e:
        error = (f"rank {topo.rank}: {e} (this rank's share {fmt_bytes(prof.host_budget)} less the host pool's "
                 f"{fmt_bytes(others)} of FPDT chunks and checkpoint staging and "
                 f"{fmt_bytes(swapped * prof.s_padding)} of alignment)")
    answers = all_gather_objects((None if result is None else result.alpha, error))
    errors = [e for _, e in answers if e is not None]
    if errors:
        raise HostMemoryError(errors[0])
    runtime.alpha = min(a for a, _ in answers)
    runtime.profile, runtime.alpha_result = prof, result
    layer = model.layers[0]
    with topo.comm.tag("memo.profile"), autocast(), pool.measuring(), gathered(layer):
        need = measure_layer(layer, x, rope, runtime.alpha).placed_bytes()  # the same probe at the chosen alpha
    host = runtime.host_need(need) + others  # the pool's exact size once Memo reserved
    error = None
    if host > prof.host_budget:
        error = (f"rank {topo.rank}: memory.activation_offload=memo: the host pool needs {fmt_bytes(host)} "
                 f"({swapped} swapped layers x {fmt_bytes(runtime.capacity(need))} at alpha {runtime.alpha:.4f}"
                 f"{f' + {fmt_bytes(others)} of FPDT chunks and checkpoint staging' if others else ''}), budget "
                 f"{fmt_bytes(prof.host_budget)}; lower memory.offload_fraction or raise memory.host_memory_gb")
    errors = [e for e in all_gather_objects(error) if e is not None]
    if errors:
        raise HostMemoryError(errors[0])
    runtime.size_for(need)
    log.info("memo offload: %s", json.dumps({
        "alpha": runtime.alpha, "alpha_this_rank": result.alpha, "binding": result.binding, "hidden": result.hidden,
        "kept_tokens": runtime.kept_tokens(prof.tokens), "tokens": prof.tokens, "inputs": inp.as_dict(),
        "profile": prof.as_dict(), "host_bytes": result.host_bytes, "host_pool_bytes": pool.size,
        "rounding_buffer_bytes": runtime.buffer_bytes}))
