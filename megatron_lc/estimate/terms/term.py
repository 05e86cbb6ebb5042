"""The interface of an estimator term: what one technique adds to the estimate of a rank.

A term is looked up by its slot's technique (``config.Techniques``; ``terms/__init__.py``) and has three steps, each
a pure function of what it is given that returns an updated copy (the default: no change):

    shape(run, shape)            -> LayerShape    which of a layer's tensors exist to be kept
    memory(run, share)           -> MemoryShare   what it keeps on the device per layer, stages, reserves on the
                                                  host, rematerialises, runs without a graph, probes at setup
    time(run, seconds, share)    -> TimeShare     what it costs: recompute seconds, bytes offloaded, host transfers

The terms of a run apply in ``Terms.in_order`` (MLP and head, attention block, executor, layer re-run, memory plan),
each given what the earlier ones set: FPDT's parked chunks are reserved on the host before Memo's alpha LP reads
the budget they leave (``MemoryShare.host_left``); the executor reads whether the attention block's backward runs
from its (out, lse) pair; the re-run in mini-sequences reads the executor's alpha and no-graph share. The one fact
read the other way is declared: FPDT parks one layer's chunks, not every layer's, when the executor's term says it
re-runs whole layers (``Term.reruns_whole_layer``, read through ``Run.terms``), and the norm's saved input with them
when the re-run's term hands it the layer input (``Term.block_reads_layer_input``).

Example, the plain executor's share is the whole skeletal set of every layer, kept on the device::

    def memory(self, run, share):
        return replace(share, kept=share.full)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...config import Config
from ..hardware import HardwareProfile
from ..dims import Dims
from ..inventory import Item, group_bytes, layer_skeletal


@dataclass(frozen=True)
class LayerShape:
    """Which of one layer's tensors exist to be kept (``inventory.layer_skeletal``'s switches)."""

    mlp_chunked: bool = False  # MsT: the MLP keeps only its input, its chunks are recomputed in its backward
    attention_parked: bool = False  # FPDT with offload: the chunks' q, k, v, out, lse live on the host
    local_qkv: bool = False  # the executor's slot holds the local q, k, v, out, lse whole (token-wise recompute)

    def items(self, dims: Dims) -> list[Item]:
        return layer_skeletal(dims, self.mlp_chunked, self.attention_parked, self.local_qkv)

    def groups(self, dims: Dims) -> dict:
        """The items' bytes by Memo group: input / attn / others."""
        return group_bytes(self.items(dims))


@dataclass(frozen=True)
class MemoryShare:
    """What the terms applied so far hold, per rank (bytes). The start (``start``) is the layer's skeletal set with
    nothing kept yet and the model states' host share: every term sets the fields of its own slot."""

    items: tuple  # the layer's skeletal tensors under the terms' shapes (``Item``s)
    groups: dict  # their bytes by Memo group: input / attn / others
    kept: float = 0.0  # kept on the device per layer, from its forward to its backward
    staging: float = 0.0  # at a layer's forward: the finished layer's tensors on their way out
    rounding: float = 0.0  # Memo's two rounding buffers (on the device for the whole step)
    recompute: float = 0.0  # rematerialised at a layer's backward, beside its transients
    no_graph: float = 0.0  # share of the rank's tokens whose forward runs without autograd (re-run in backward)
    rerun: Optional[float] = None  # share re-run through the core attention's (out, lse) pair; None: under autograd
    attention_from_lse: bool = False  # the attention block's backward runs from its (out, lse) pair
    pre_no_graph_tokens: float = 0.0  # tokens whose pre (norm, QKV, RoPE) runs without autograd at once, forward
    alpha: Optional[float] = None  # Memo's offload fraction
    chunk_tokens: Optional[float] = None  # tokens through the linears per mini-sequence of the re-run
    chunk_saved: float = 0.0  # what one mini-sequence's re-run saves for its backward
    attn_saved: float = 0.0  # recomputed for the attention backward only (the dropped tokens' q, k, v)
    remade: float = 0.0  # inputs of a segment's lower layers, re-made at its top layer's backward (no prefetch there)
    prefetch: float = 0.0  # the next layer's input, fetched from the host during a layer's backward
    prefetch_after_attention: float = 0.0  # ... fetched only once the attention backward is done
    head_kept: float = 0.0  # the final norm's and the head's tensors kept for the backward
    head_softmax: float = 0.0  # of those, the saved softmax (turned into its gradient in the head's backward)
    host: tuple = ()  # (what, bytes) reserved on the host per rank, in the order the terms reserved them
    setup_probes: tuple = ()  # the peaks of the calibrations' probes at setup, above the parameters
    setup_traces_step: bool = False  # setup traces a whole micro-batch (the memory plan)
    fragmentation: float = 0.0  # share of the activation peak the allocator cannot use
    notes: tuple = ()

    @classmethod
    def start(cls, run: "Run", shape: LayerShape, states_host: float) -> "MemoryShare":
        """The layer of ``shape``, nothing kept yet; the model states' host share (FSDP2's CPU offload) reserved."""
        items = tuple(shape.items(run.dims))
        return cls(items=items, groups=group_bytes(list(items)), host=(("model states", states_host),))

    @property
    def full(self) -> float:
        """Every skeletal tensor of one layer."""
        return sum(self.groups.values())

    @property
    def host_total(self) -> float:
        total = 0.0
        for _, b in self.host:
            total += b
        return total

    def host_left(self, budget: float) -> float:
        """``budget`` less what the terms before reserved on the host."""
        for _, b in self.host:
            budget -= b
        return budget


@dataclass(frozen=True)
class LayerSeconds:
    """One layer's seconds per micro-batch before the terms: compute and the exposed tp / cp communication."""

    linear_fwd: float
    attention_fwd: float
    attention_bwd: float
    tp_fwd: float = 0.0
    tp_bwd: float = 0.0
    cp_fwd: float = 0.0
    cp_bwd: float = 0.0


@dataclass(frozen=True)
class TimeShare:
    """What the terms applied so far cost per layer and micro-batch (seconds; ``offloaded`` in bytes)."""

    shape: LayerShape  # the layer the memory terms shaped
    alpha: Optional[float] = None  # Memo's offload fraction, as the memory estimate chose it
    recompute: float = 0.0  # run again in the layer's backward
    offloaded: float = 0.0  # bytes that cross PCIe each way, hidden under the layer's compute but for the excess
    host_fwd: float = 0.0  # exposed host <-> device transfers of the layer's forward
    host_bwd: float = 0.0  # ... and of its backward


class Term:
    """One technique's share of the estimate (see the module doc); the defaults add nothing."""

    reruns_whole_layer = False  # an executor: the whole layer, attention included, runs again in its backward
    block_reads_layer_input = False  # a re-run: FPDT's block runs norm 1 in its chunk projections (and parks its input)

    def shape(self, run: "Run", shape: LayerShape) -> LayerShape:
        return shape

    def memory(self, run: "Run", share: MemoryShare) -> MemoryShare:
        return share

    def time(self, run: "Run", seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        return share


@dataclass(frozen=True)
class Terms:
    """The term of each slot of a run (``terms_for``)."""

    mlp_and_head: Term
    attention_block: Term
    executor: Term
    layer_rerun: Term
    memory_plan: Term

    @property
    def in_order(self) -> tuple:
        """The order the terms apply in (see the module doc)."""
        return self.mlp_and_head, self.attention_block, self.executor, self.layer_rerun, self.memory_plan

    def layer_shape(self, run: "Run") -> LayerShape:
        shape = LayerShape()
        for term in self.in_order:
            shape = term.shape(run, shape)
        return shape

    def memory(self, run: "Run", share: MemoryShare) -> MemoryShare:
        for term in self.in_order:
            share = term.memory(run, share)
        return share

    def time(self, run: "Run", seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        for term in self.in_order:
            share = term.time(run, seconds, share)
        return share


@dataclass(frozen=True)
class Run:
    """What every term reads: the config, its sizes, the hardware, the terms of the other slots, and the inputs of
    the memory estimate (``t_layer_fwd``: one layer's forward seconds, for Memo's LP; ``peak_override``: an
    activation peak measured from a plan or trace)."""

    cfg: Config
    dims: Dims
    hw: HardwareProfile
    terms: Terms
    t_layer_fwd: float = 0.0
    peak_override: Optional[float] = None

    @property
    def host_bytes_per_s(self) -> float:
        """This rank's host link while every rank of its node copies (``HardwareProfile.host_copy_bytes_per_s``)."""
        return self.hw.host_copy_bytes_per_s(min(self.dims.world, self.hw.gpus_per_node))
