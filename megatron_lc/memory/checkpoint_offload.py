"""Activation checkpoints on the host (``memory.activation_offload: checkpoints``): a layer's forward runs without a
graph and its backward re-runs the whole layer -- attention included -- from its input. The mode of DeepSpeed's
``cpu_checkpointing`` and of Arctic Long Sequence Training ("activation checkpoints offloaded to host"), for the
lengths where Memo's host copies bind: Memo keeps input + attention output + lse (+ alpha of the rest) of every layer
on the host, this mode the input alone -- e.g. Llama3-8B, 4M tokens over 8 ranks: 16 KiB per token and layer (fp32
residual stream) instead of ~40 KiB -- and pays one more attention forward per layer in the backward.

Segments (``memory.checkpoint_every`` = k): only the input of every k-th layer (0, k, 2k, ...) goes to the host, so
ceil(L / k) inputs instead of L. The backward of a segment's top layer fetches the segment's checkpoint and runs its
lower layers forward again without a graph (their weights gathered one by one under FSDP2) to re-make their inputs on
the device; each layer of the segment then re-runs with autograd from its input and backpropagates, top down.
Example, L = 5, k = 3: segments {0, 1, 2} and {3, 4}, layers 0 and 3 on the host; layer 4's backward fetches x3 and
runs layer 3 -> x4; layer 3's backward fetches x3 again; layer 2's fetches x0 and runs layers 0, 1 -> x1, x2. The
checkpoint's device copy is dropped once it re-made x_{start+1} (its host copy stays until its layer's backward), so
at most k - 1 re-made inputs are on the device at once; the re-run costs L - ceil(L / k) more layer forwards a step.

Timeline of one micro-batch (``DeviceAdapter.copy_streams``: one offload, one prefetch stream)::

    forward   layer i runs without autograd; a checkpoint layer's input -> host[i] on the offload stream while the
              next layers compute (the device input is released when its copy is done)
    backward  layer i: its input is a re-made one, or host[start]'s prefetch (issued during the backward before);
              a segment's top layer first re-makes its segment's inputs; re-run with autograd, dy -> dx; the
              checkpoint needed next is prefetched (the segment start during layer start+1's backward, the segment
              below's start during layer start's: with layer_chunk_size after this layer's attention backward, its
              peak); host[start] goes back to the pool after layer start's backward fetched it

The host copies come from the model's ``HostPool`` (one allocation, reserved here: ceil(L / k) x one input, exact).
``memory.layer_chunk_size`` = c: the forward, the re-making and the re-run take the token-wise parts c tokens at a time
(``chunked_layer.py``; with FPDT's block, inside each of its chunks), so outside the attention the re-run holds O(c)
rows instead of the whole layer's tensors.

Exact: the re-run and the re-making are the same forward (under the forward's autocast) on the same input (bit for
bit on CPU). Under FSDP2 the layer's weights are gathered by its pre-backward hook before its re-run (the executor
runs inside ``TransformerLayer.forward``); the re-making gathers each lower layer explicitly (``fsdp.gathered``).
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from ..device import DeviceAdapter, HostPool
from ..parallel.fsdp import gathered
from .chunked_layer import ChunkedLayer, CoreAttentionPart
from .forward_state import as_in_forward, autocast_state, backward_from


class CheckpointOffload:
    """Run-time state: the host copies of the checkpoints, the prefetched and re-made device inputs, the streams.

    A technique runtime (``compose/context.py``): ``bind`` (the copy streams, the pool's device), ``calibrate``
    (nothing to measure: the pool's share is ceil(L / k) layer inputs, from the layout, in the run's residual
    dtype), ``allocate`` (nothing on the device: an input is fetched into a fresh tensor in its backward).
    ``attention_part``: the chunked layer's attention (``chunked_layer.CoreAttentionPart`` or ``BlockAttentionPart``
    around FPDT's block)."""

    TAG = "checkpoints"

    def __init__(self, num_layers: int, pool: HostPool, chunk_tokens: Optional[int] = None, sp_groups: int = 1,
                 every: int = 1, attention_part=CoreAttentionPart):
        self.n, self.pool, self.every = num_layers, pool, every
        # memory.layer_chunk_size; the tp blocks of gathered rows (sequence parallelism)
        self.chunk_tokens, self.sp_blocks, self.part = chunk_tokens, sp_groups, attention_part
        self.dev: Optional[DeviceAdapter] = None
        self.host: dict = {}  # checkpoint layer -> (host tensor, its offload event)
        self.fetched: dict = {}  # checkpoint layer -> (device tensor, its prefetch event)
        self.remade: dict = {}  # layer -> its input, re-made on the device by its segment's re-run
        self.forwards: dict = {}  # layer -> (module, rope, documents, autocast) of the forward, to re-make from
        self.bytes_to_host = 0
        self.host_blocks_peak = 0  # the most checkpoints on the host at once

    @property
    def checkpoints(self) -> int:
        """Layer inputs on the host per micro-batch: ceil(L / k)."""
        return -(-self.n // self.every)

    def start(self, layer: int) -> int:
        """The first layer of ``layer``'s segment (its checkpoint)."""
        return layer // self.every * self.every

    def reserve(self, input_shape: tuple, dtype: torch.dtype) -> int:
        """Reserve the pool's share: ceil(L / k) layer inputs (``[block tokens, micro-batch, hidden]``)."""
        nbytes = self.checkpoints * HostPool.block_bytes(input_shape, dtype)
        self.pool.reserve(self.TAG, nbytes)
        return nbytes

    def bind(self, device: torch.device) -> None:
        self.dev = DeviceAdapter.for_device(device)
        self.offload_stream, self.prefetch_stream = self.dev.copy_streams()
        self.pool.bind(self.dev)

    def calibrate(self, model, env) -> None:
        """The residual stream between layers, ``[s, b, h]`` per rank, for every checkpoint (``env``: the run's
        ``compose.Calibration``)."""
        layout = env.layout
        self.reserve((layout.block_seq_length, layout.micro_batch_size, model.cfg.hidden_size),
                     env.execution.residual_dtype)

    def allocate(self) -> None:
        pass

    def chunked(self, layer, rope, documents, S: int, autocast: list) -> Optional[ChunkedLayer]:
        """The layer's run in mini-sequences (``chunked_layer.py``), or None when there are none: no
        ``layer_chunk_size``, or a core attention's chunk holds all S rows (FPDT's block keeps its own chunks)."""
        if self.chunk_tokens is None or (self.part is CoreAttentionPart and self.chunk_tokens >= S):
            return None
        return ChunkedLayer(layer, rope, documents, S, self.chunk_tokens, self.sp_blocks, autocast, self.part)

    def run_without_graph(self, layer, x: torch.Tensor, rope, documents, autocast: list) -> torch.Tensor:
        """The layer's forward without autograd, in mini-sequences when chunked (the forward and the re-making)."""
        chunked = self.chunked(layer, rope, documents, x.shape[0], autocast)
        with as_in_forward(autocast, grad=False):
            return chunked.forward(x) if chunked else layer.plain_forward(x, rope, documents)

    def forward_done(self, layer, x: torch.Tensor, rope, documents, autocast: list) -> None:
        """After layer ``layer``'s forward: its input to the host if it is a checkpoint, else remember how to run it
        again for its segment's re-making."""
        n = layer.layer_number
        if n == self.start(n):
            self.offload(n, x)
        if n + 1 < self.n and self.start(n + 1) == self.start(n):  # a lower layer of its segment
            self.forwards[n] = (layer, rope, documents, autocast)

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
        self.host_blocks_peak = max(self.host_blocks_peak, len(self.host))

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

    def fetch(self, layer: int, last: bool = True) -> torch.Tensor:
        """``layer``'s input on the device, ready on the compute stream; with ``last`` its host block goes back to
        the pool (a segment's top layer fetches its checkpoint once more before the checkpoint's own backward)."""
        self.prefetch(layer)
        d, ev = self.fetched.pop(layer)
        self.dev.wait_event(ev)
        # allocated on the prefetch stream, used and freed on the compute stream
        self.dev.record_stream(d, self.dev.current_stream())
        if last:
            h, _ = self.host.pop(layer)
            self.pool.give(h, after=ev)
        return d

    def next_checkpoint(self, layer: int) -> int:
        """The checkpoint the backward after ``layer``'s needs from the host (-1: none, a re-made input): layer - 1
        when it is a segment start (``layer``'s own start), the segment below's start when ``layer`` starts one."""
        if layer == 0:
            return -1
        return self.start(layer - 1) if (layer - 1) % self.every == 0 or layer % self.every == 0 else -1

    def input_for_backward(self, layer: int) -> torch.Tensor:
        """``layer``'s input on the device for its re-run: its checkpoint (the last fetch of it), a re-made one, or
        -- for a segment's top layer -- re-made now from the checkpoint through the segment's lower layers."""
        start = self.start(layer)
        if layer == start:
            return self.fetch(layer)
        if layer not in self.remade:
            x = self.fetch(start, last=False)
            for j in range(start, layer):
                module, rope, documents, autocast = self.forwards.pop(j)
                with gathered(module):
                    x = self.run_without_graph(module, x, rope, documents, autocast)
                self.remade[j + 1] = x
            del x
        return self.remade.pop(layer)


class _OffloadedLayer(torch.autograd.Function):
    """forward: the layer without autograd, a checkpoint's input to the host; backward: the input back (fetched or
    re-made), the layer again with autograd (under the forward's autocast), ``dy`` through it -- in mini-sequences
    with ``layer_chunk_size``."""

    @staticmethod
    def forward(ctx, rt: CheckpointOffload, layer, rope, documents, x: torch.Tensor, _always: torch.Tensor):
        ctx.autocast = autocast_state()
        y = rt.run_without_graph(layer, x, rope, documents, ctx.autocast)
        rt.forward_done(layer, x, rope, documents, ctx.autocast)
        ctx.rt, ctx.layer, ctx.rope, ctx.documents = rt, layer, rope, documents
        ctx.x_requires_grad = x.requires_grad
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        rt, layer = ctx.rt, ctx.layer
        x = rt.input_for_backward(layer.layer_number).detach().requires_grad_(ctx.x_requires_grad)
        chunked = rt.chunked(layer, ctx.rope, ctx.documents, x.shape[0], ctx.autocast)
        # the next checkpoint travels while this layer recomputes: in mini-sequences from the end of the attention
        # backward (the re-run's peak) on
        prefetch = partial(rt.prefetch, rt.next_checkpoint(layer.layer_number))
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
