"""Install recompute / Memo offload on a built model (called by ``apply_memory_features``).

    memory.recompute_granularity  memory.activation_offload   what runs
    none                          none                        plain autograd
    selective                     none                        core attention checkpointed (Megatron's meaning)
    full                          none                        token-wise recompute: keep input + attention out/lse,
                                                              recompute norm/QKV/RoPE/out-proj/MLP (alpha = 0)
    none | full                   memo                        Memo: rounding buffers, input + attention out/lse
                                                              offloaded, first alpha of the other tensors' tokens
                                                              offloaded, the rest recomputed

With ``memo``, before training: the profiler measures one layer (sizes, forward time, bandwidth, host memory),
alpha is solved (``offload_fraction: auto``) or checked (a number) against the host budget, every rank agrees on
the smallest alpha, and the two rounding buffers are allocated.
"""
from __future__ import annotations

import json
import logging
import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config, ConfigError
from ..parallel.topology import Topology
from .alpha import AlphaInputs, HostMemoryError, check_fixed_alpha, solve_alpha
from .attention_io import lse_attention
from .offload import ALIGN, MemoRuntime
from .executor import MemoExecutor
from .recompute import SelectiveExecutor

log = logging.getLogger("megatron_lc")


def _device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def install_recompute(model: nn.Module, cfg: Config, topo: Topology) -> None:
    """Set every layer's executor according to ``cfg.memory``; with Memo also profile, solve alpha, allocate."""
    m = cfg.memory
    if m.recompute_granularity == "none" and m.activation_offload == "none":
        return
    if m.recompute_granularity == "selective":
        if m.activation_offload != "none":
            raise ConfigError(f"memory.recompute_granularity=selective recomputes core attention, "
                              f"memory.activation_offload={m.activation_offload} keeps it: use full or none with memo")
        for layer in model.layers:
            layer.executor = SelectiveExecutor()
        return
    offload = m.activation_offload == "memo"
    feature = "memory.activation_offload=memo" if offload else "memory.recompute_granularity=full"
    device = _device(cfg)
    model.to(device)
    G = topo.tp if (cfg.parallel.sequence_parallel and topo.tp > 1) else 1
    fixed = None if m.offload_fraction == "auto" else float(m.offload_fraction)
    rt = MemoRuntime(len(model.layers), alpha=fixed if fixed is not None else 0.0, offload=offload, device=device)
    # block mode (io None) when the attention block has no separate core attention (FPDT replaces it whole)
    ios = [None if getattr(layer.self_attention, "core_attention", None) is None else
           lse_attention(layer.self_attention.core_attention, cfg.parallel.attention_backend, feature)
           for layer in model.layers]
    for layer, io in zip(model.layers, ios):
        layer.executor = MemoExecutor(rt, io, G)
    model.memo_runtime = rt
    if offload:
        prepare_offload(model, cfg, topo, rt, ios[0], G, fixed, device)


def _gather(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def prepare_offload(model, cfg: Config, topo: Topology, rt: MemoRuntime, io, G: int, fixed, device) -> None:
    """Profile layer 0, choose alpha (the smallest over ranks), allocate the rounding buffers; log it all."""
    from .profiler import profile_layer

    with topo.comm.tag("memo.profile"):
        prof = profile_layer(model, cfg, topo, io, G, device, timing=fixed is None)
    inp = AlphaInputs(s_input=prof.s_input, s_attn=prof.s_attn, s_others=prof.s_others,
                      bandwidth=prof.bw_d2h if fixed is None else math.inf,
                      t_layer=prof.t_layer if fixed is None else math.inf,
                      num_layers=len(model.layers), host_budget=prof.host_budget)
    result, error = None, None
    try:
        result = solve_alpha(inp) if fixed is None else check_fixed_alpha(inp, fixed)
    except HostMemoryError as e:
        error = f"rank {topo.rank}: {e}"
    gathered = _gather((None if result is None else result.alpha, error))
    errors = [e for _, e in gathered if e is not None]
    if errors:
        raise HostMemoryError(errors[0])
    rt.alpha = min(a for a, _ in gathered)
    rt.profile, rt.alpha_result = prof, result
    S = prof.tokens
    kept = rt.kept_tokens(S)
    regions = 32  # generous count of placed regions per layer, each padded to ALIGN
    need = prof.s_input + prof.s_attn + math.ceil(prof.s_others * kept / max(S, 1))  # "other" scales with tokens
    rt.allocate(need + regions * ALIGN)
    log.info("memo offload: %s", json.dumps({
        "alpha": rt.alpha, "alpha_this_rank": result.alpha, "binding": result.binding, "hidden": result.hidden,
        "kept_tokens": kept, "tokens": S, "inputs": inp.as_dict(), "profile": prof.as_dict(),
        "host_bytes": result.host_bytes, "rounding_buffer_bytes": rt.buffers[0].capacity}))
