"""FPDT's share of the host pool, measured before training (``training/setup.py``, with ``memory.fpdt_offload``).

One forward and one backward of layer 0's block, on a synthetic input of the training shape, run with the pool in
measuring mode (plain tensors; the pool's first-fit runs on an unbounded range). The layers are identical, so what
layer 0 parks is what every layer parks:

    F = bytes one layer's forward parks: q^, k^, v^, o^ (compute dtype) and lse (fp32) of each of the u chunks, and
        what each chunk projection saved (its input chunk; under autocast its bf16 cast; RoPE rows cut for SP)
    B = what a backward adds at its start: do^ (compute dtype) and the fp32 dq accumulator of each chunk

The L layers' forwards park F each, one after the other (nothing is given back during a forward); the last layer's
backward adds B on top; every later backward starts after the layer above gave all its blocks back, so its B fits
in the range just freed. The pool is reserved ``L * F + B``: the high-water mark of a step, to the byte
(``tests/device/test_host_pool.py``). Where a layer re-runs whole in its backward (``memory.layer_reruns_whole``: the
host checkpoints) the forwards run without a graph and park nothing; each re-run parks F and its backward gives it
back before the next one, so ``F + B`` (with ``layer_chunk_size`` the block runs norm 1 inside its chunk projections,
``block.attend``, so F counts the norm's saved input too, measured so). Example, u = 4 chunks, one chunk's q^ = k^ =
v^ = o^ = 64 KiB (bf16), lse 2 KiB, projection input 128 KiB: F = 4 * (4 * 64 + 2 + 128) KiB = 1544 KiB; B = 4 * (64 + 128) KiB = 768 KiB; 24 layers:
24 * 1544 + 768 KiB = 36.9 MiB (each view rounded up to ``HostPool.ALIGN``).
"""
from __future__ import annotations

import contextlib

import torch

from ...config import resolve_techniques
from ...model.probe import probe_input
from ...parallel.fsdp import gathered


def measure_block(block, x: torch.Tensor, rope, autocast=contextlib.nullcontext, norm=None) -> tuple[int, int]:
    """(F, B) of ``block`` (an ``FPDTSelfAttention`` with offload) on input ``x``: the pool bytes its forward parks
    and what its backward adds at its start. The forward runs under ``autocast()``, the backward outside it, as in
    a training step; the block's parameter gradients are left as they were. ``norm``: the layer's norm 1 inside the
    chunk projections, as the host checkpoints' chunked layer runs the block (its saved input is parked too)."""
    pool = block.state.pool
    params = list(block.parameters()) + ([] if norm is None else list(norm.parameters()))
    grads = [p.grad for p in params]
    with pool.measuring() as fit, torch.enable_grad():
        with autocast():
            out = block(x, rope, norm=norm)
        forward = fit.high
        out.backward(torch.zeros_like(out))
        total = fit.high
    for p, g in zip(params, grads):
        p.grad = g
    return forward, total - forward


def reserve_for_layers(block, x: torch.Tensor, rope, num_layers: int, autocast=contextlib.nullcontext,
                       norm=None) -> int:
    """Measure ``block`` (``measure_block``) and reserve ``num_layers * F + B`` bytes of its pool; returns that."""
    forward, backward = measure_block(block, x, rope, autocast, norm)
    need = num_layers * forward + backward
    block.state.pool.reserve(block.state.TAG, need)
    return need


def calibrate_fpdt(model, env) -> int:
    """Reserve FPDT's share of the host pool for ``model`` (every rank calls this: the block's collectives run);
    ``env``: the run's ``compose.Calibration``. Returns the bytes reserved (0 without ``memory.fpdt_offload``:
    nothing is parked)."""
    if not env.cfg.memory.fpdt_offload:
        return 0
    x, rope = probe_input(model, env.layout, env.execution.device, env.execution.residual_dtype)  # the block's input
    layer = model.layers[0]
    # the host checkpoints' chunked layer hands the block the layer input, norm 1 inside its chunk projections
    norm = layer.input_layernorm if resolve_techniques(env.cfg, env.layout).layer_rerun == "block_mini_sequences" \
        else None
    with env.topo.comm.tag("fpdt.profile"), gathered(layer):
        parked = 1 if env.cfg.memory.layer_reruns_whole else len(model.layers)
        return reserve_for_layers(layer.self_attention, x, rope, parked, env.execution.autocast, norm)
