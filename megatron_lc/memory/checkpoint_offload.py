"""Activation checkpoints on the host (``memory.activation_offload: checkpoints``): each layer keeps only its input,
on the host, and its backward re-runs the whole layer -- attention included -- from it. The mode of DeepSpeed's
``cpu_checkpointing`` and of Arctic Long Sequence Training ("activation checkpoints offloaded to host"), for the
lengths where Memo's host copies bind: Memo keeps input + attention output + lse (+ alpha of the rest) of every layer
on the host, this mode the input alone -- e.g. Llama3-8B, 4M tokens over 8 ranks: 16 KiB per token and layer (fp32
residual stream) instead of ~40 KiB -- and pays one more attention forward per layer in the backward.

Timeline, layers 0..3 of one micro-batch (``DeviceAdapter.copy_streams``: one offload, one prefetch stream)::

    forward   layer i runs without autograd; its input -> host[i] on the offload stream while layer i+1 computes
              (the device input is released when its copy is done)
    backward  layer i: wait for host[i]'s prefetch (issued during layer i+1's backward), issue host[i-1]'s,
              re-run layer i with autograd from the fetched input, backpropagate dy -> dx; host[i] back to the pool
              (with layer_chunk_size, host[i-1]'s prefetch waits for layer i's attention backward, its peak)

The host copies come from the model's ``HostPool`` (one allocation, reserved here: layers x one input, exact).
``memory.layer_chunk_size`` = c: the forward and the re-run take the token-wise parts c tokens at a time
(``chunked_layer.py``), so outside core attention the re-run holds O(c) rows instead of the whole layer's tensors.

Exact: the re-run is the same forward (under the forward's autocast) on the same input (bit for bit on CPU). Under FSDP2
the layer's weights are gathered by its pre-backward hook before the re-run (the executor runs inside
``TransformerLayer.forward``).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..device import DeviceAdapter, HostPool
from .chunked_layer import ChunkedLayer
from .forward_state import as_in_forward, autocast_state, backward_from


class CheckpointOffload:
    """Run-time state: the host copies of the layers' inputs, the prefetched device copies, the streams.

    A technique runtime (``compose/context.py``): ``bind`` (the copy streams, the pool's device), ``calibrate``
    (nothing to measure: the pool's share is every layer's input, from the layout, in the run's residual dtype),
    ``allocate`` (nothing on the device: a layer's input is fetched into a fresh tensor in its backward)."""

    TAG = "checkpoints"

    def __init__(self, num_layers: int, pool: HostPool, chunk_tokens: Optional[int] = None, sp_groups: int = 1):
        self.n, self.pool = num_layers, pool
        # memory.layer_chunk_size; the tp blocks of gathered rows (sequence parallelism)
        self.chunk_tokens, self.sp_blocks = chunk_tokens, sp_groups
        self.dev: Optional[DeviceAdapter] = None
        self.host: dict = {}  # layer -> (host tensor, its offload event)
        self.fetched: dict = {}  # layer -> (device tensor, its prefetch event)
        self.bytes_to_host = 0

    def reserve(self, input_shape: tuple, dtype: torch.dtype) -> int:
        """Reserve the pool's share: every layer's input (``[block tokens, micro-batch, hidden]``)."""
        nbytes = self.n * HostPool.block_bytes(input_shape, dtype)
        self.pool.reserve(self.TAG, nbytes)
        return nbytes

    def bind(self, device: torch.device) -> None:
        self.dev = DeviceAdapter.for_device(device)
        self.offload_stream, self.prefetch_stream = self.dev.copy_streams()
        self.pool.bind(self.dev)

    def calibrate(self, model, env) -> None:
        """The residual stream between layers, ``[s, b, h]`` per rank, for every layer (``env``: the run's
        ``compose.Calibration``)."""
        layout = env.layout
        self.reserve((layout.block_seq_length, layout.micro_batch_size, model.cfg.hidden_size),
                     env.execution.residual_dtype)

    def allocate(self) -> None:
        pass

    def chunked(self, layer, rope, documents, S: int, autocast: list) -> Optional[ChunkedLayer]:
        """The layer's run in mini-sequences (``chunked_layer.py``), or None when a chunk holds all S rows."""
        if self.chunk_tokens is None or self.chunk_tokens >= S:
            return None
        return ChunkedLayer(layer, rope, documents, S, self.chunk_tokens, self.sp_blocks, autocast)

    def offload(self, layer: int, x: torch.Tensor) -> None:
        """Copy layer ``layer``'s input to the host on the offload stream (``x`` kept alive until it is done)."""
        if self.dev is None:
            self.bind(x.device)
        h = self.pool.take(x.shape, x.dtype)
        ready = self.dev.record_event()
        with self.dev.stream(self.offload_stream):
            self.dev.wait_event(ready, self.offload_stream)
            h.copy_(x, non_blocking=True)
            self.dev.record_stream(x, self.offload_stream)
            self.host[layer] = (h, self.dev.record_event(self.offload_stream))
        self.bytes_to_host += x.numel() * x.element_size()

    def prefetch(self, layer: int) -> None:
        """Start copying ``layer``'s input back to the device (no-op when it is not on the host)."""
        if layer < 0 or layer not in self.host or layer in self.fetched:
            return
        h, offloaded = self.host[layer]
        ready = self.dev.record_event()
        with self.dev.stream(self.prefetch_stream):
            self.dev.wait_event(ready, self.prefetch_stream)
            self.dev.wait_event(offloaded, self.prefetch_stream)
            d = torch.empty(h.shape, dtype=h.dtype, device=self.dev.device)
            d.copy_(h, non_blocking=True)
            self.fetched[layer] = (d, self.dev.record_event(self.prefetch_stream))

    def fetch(self, layer: int) -> torch.Tensor:
        """``layer``'s input on the device, ready on the compute stream; its host block goes back to the pool."""
        self.prefetch(layer)
        d, ev = self.fetched.pop(layer)
        self.dev.wait_event(ev)
        # allocated on the prefetch stream, used and freed on the compute stream
        self.dev.record_stream(d, self.dev.current_stream())
        h, _ = self.host.pop(layer)
        self.pool.give(h, after=ev)
        return d


class _OffloadedLayer(torch.autograd.Function):
    """forward: the layer without autograd, its input to the host; backward: input back, the layer again with
    autograd (under the forward's autocast), ``dy`` through it -- in mini-sequences with ``layer_chunk_size``."""

    @staticmethod
    def forward(ctx, rt: CheckpointOffload, layer, rope, documents, x: torch.Tensor, _always: torch.Tensor):
        ctx.autocast = autocast_state()
        chunked = rt.chunked(layer, rope, documents, x.shape[0], ctx.autocast)
        with torch.no_grad():
            y = chunked.forward(x) if chunked else layer.plain_forward(x, rope, documents)
        rt.offload(layer.layer_number, x)
        ctx.rt, ctx.layer, ctx.rope, ctx.documents = rt, layer, rope, documents
        ctx.x_requires_grad = x.requires_grad
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rt, layer = ctx.rt, ctx.layer
        x = rt.fetch(layer.layer_number).detach().requires_grad_(ctx.x_requires_grad)
        chunked = rt.chunked(layer, ctx.rope, ctx.documents, x.shape[0], ctx.autocast)
        # the next layer's input travels while this one recomputes: in mini-sequences from the end of the attention
        # backward (the re-run's peak) on, during pre's chunks
        prefetch = partial(rt.prefetch, layer.layer_number - 1)
        if chunked:
            dx = chunked.backward(x, dy, after_attention=prefetch)
        else:
            prefetch()
            with as_in_forward(ctx.autocast, grad=True):
                y = layer.plain_forward(x, ctx.rope, ctx.documents)
            backward_from(y, dy)
            del y
            dx = x.grad
        return None, None, None, None, dx if ctx.x_requires_grad else None, None


class CheckpointOffloadExecutor:
    """The layer executor of ``activation_offload: checkpoints`` (built by the model spec)."""

    def __init__(self, runtime: CheckpointOffload):
        self.runtime = runtime
        # so the output requires grad (and parameter grads flow) even when the layer input does not
        self._always_grad = torch.empty(0, requires_grad=True)

    def __call__(self, layer, x: torch.Tensor, rope, documents=None) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return layer.plain_forward(x, rope, documents)
        return _OffloadedLayer.apply(self.runtime, layer, rope, documents, x.contiguous(), self._always_grad)
