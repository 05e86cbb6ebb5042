"""Per-rank device memory and per-node host memory of a training step.

The peak is the largest of four moments of a steady-state step (step >= 2, optimizer states exist):

* ``head forward``: every layer's kept tensors + final norm + logits being turned into the loss;
* ``head backward``: the same with the saved softmax turned into its gradient;
* ``layer backward``: the last layer's backward (all layers' kept tensors still alive, its recompute and grads) or the
  first layer's (every layer's grads), whichever is larger;
* ``optimizer``: parameters + full gradients + states + sync/clip/AdamW temporaries (no activations);
* ``setup``: before step 1, the calibrations' probes on the sharded model (``setup_bytes``), below the step.

The static part: fp32 parameters (the framework keeps fp32 master weights; ``train.bf16`` autocasts on GPU),
fp32 gradients (allocated in backward; present in the forward too when there are several micro-batches),
AdamW's two fp32 states (ZeRO-1 over dp x cp with ``parallel.use_distributed_optimizer``: torch's
ZeroRedundancyOptimizer partition, whole parameters per rank), and under autocast the bf16 copies of the weights
that autocast caches from the first forward use until the backward is done.

What each layer keeps, stages, rematerialises and reserves on the host is the memory techniques' share: one term
per technique (``terms/``, looked up by ``config.Techniques``), applied in order; this module only adds what they
give into the moments. Example, ``activation_offload: memo`` with MsT: ``MiniSequenceMlpAndHead`` leaves the MLP's
input and the head's lse, ``MemoOffload`` keeps nothing per layer but two rounding buffers and reserves n - 2
layers' kept bytes on the host, ``CachingAllocator`` adds 10% of the activation peak on CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import Config
from . import transient as T
from .attention_kernels import kernel_workspaces
from .hardware import HardwareProfile
from .dims import Dims
from .inventory import shared_skeletal
from .states import model_state_bytes
from .terms import MemoryShare, Run, Terms


@dataclass
class MemoryEstimate:
    parts: dict  # name -> bytes (persistent parts and the activation peak)
    phases: dict  # moment -> peak bytes
    peak: float
    peak_phase: str
    capacity: float  # bytes available to tensors on one rank
    host_per_rank: float
    host_per_node: float
    host_capacity: float
    alpha: Optional[float]
    layer_items: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    fragmentation: float = 0.0  # the reserve added to the activation moments (CUDA, ``memory.plan: off``)
    optimizer_states: float = 0.0  # AdamW's states on the device: in every moment from the first optimizer step on

    @property
    def allocated_peak(self) -> float:
        """The largest moment's live tensor bytes, without the fragmentation reserve: what
        ``torch.cuda.max_memory_allocated`` and a rehearsal (``megatron_lc/rehearsal``) measure."""
        return max(v - (0.0 if k in ("optimizer", "setup") else self.fragmentation) for k, v in self.phases.items())

    @property
    def first_step_peak(self) -> float:
        """``allocated_peak`` of the first step: AdamW makes its states at its first ``step``, so the first step's
        forward and backward hold none (its ``optimizer`` moment already counts them; a rehearsal of one step)."""
        return max(v - (0.0 if k in ("optimizer", "setup") else self.fragmentation + self.optimizer_states)
                   for k, v in self.phases.items())

    @property
    def fits_device(self) -> bool:
        return self.peak <= self.capacity

    @property
    def fits_host(self) -> bool:
        return self.host_per_node <= self.host_capacity

    @property
    def status(self) -> str:
        """``fits`` | ``oom`` (device) | ``oohm`` (out of host memory, Memo's term)."""
        if not self.fits_device:
            return "oom"
        if not self.fits_host:
            return "oohm"
        return "fits"


def setup_bytes(ms: dict, share: MemoryShare, shared: float, on_host: float, step_backward: float) -> float:
    """What setup holds at its peak (``training/setup.py``): the parameters (FSDP2: the shards and one gathered
    layer -- sharding comes before anything large lands on the device), no gradient and no optimizer state yet,
    and the largest of the rounding buffers and the techniques' probes (``MemoryShare.setup_probes``: Memo's
    calibration runs layer 0 with every token kept, FPDT's one block forward and backward; a memory plan traced at
    setup, a micro-batch's forward and backward: ``step_backward``)."""
    traced = (step_backward,) if share.setup_traces_step else ()
    probe = max((share.rounding, *share.setup_probes, *traced))
    return ms["params"] + shared + on_host + probe


def estimate_memory(cfg: Config, dims: Dims, hw: HardwareProfile, terms: Terms, t_layer_fwd: float,
                    activation_peak_override: Optional[float] = None, states: str = "framework") -> MemoryEstimate:
    """Device peak per rank and host memory per node for ``cfg`` on ``hw`` with the techniques' ``terms``
    (``terms.terms_for``; its ``recompute_style`` what-if included). ``t_layer_fwd``: one layer's forward
    seconds, for Memo's alpha LP when ``memory.offload_fraction`` is ``auto``; ``activation_peak_override``: the
    activation peak from a memory plan or trace (replaces the formulas for activations); ``states``: a preset of
    ``states.py`` (``framework`` = this trainer; the others are what-ifs for comparing with the papers)."""
    run = Run(cfg, dims, hw, terms, t_layer_fwd, activation_peak_override)
    ms = model_state_bytes(cfg, dims, states)
    share = terms.memory(run, MemoryShare.start(run, terms.layer_shape(run), ms.get("host", 0.0)))
    host_rank = share.host_total
    on_host = host_rank if hw.device == "cpu" else 0.0  # on CPU "host" copies live in the same memory

    # ---- the moments ---------------------------------------------------------------------------------------
    final, softmax = share.head_kept, share.head_softmax
    # + the micro-batches
    shared = sum(i.bytes for i in shared_skeletal(dims)) + dims.micro_batches * dims.tokens * 28.0
    layers_kept = dims.num_layers * share.kept + share.rounding
    chunk = share.chunk_tokens
    # the next layer's input, prefetched during a layer's backward: at its start (in ``recompute``), or after the
    # attention backward (``T.layer_backward``'s pre phase)
    prefetch, pre_phase = share.prefetch, share.prefetch_after_attention

    def layer_bwd(pre_prefetch: float) -> float:
        return (share.recompute + T.layer_backward(cfg, dims, share.rerun, chunk, share.chunk_saved,
                                                   share.attn_saved, pre_prefetch) + shared + on_host)

    bwd = layer_bwd(pre_phase)
    # the first layer's backward (the last to run) has every layer's gradients; the layers after it have freed
    # their kept tensors (token-wise recompute drops its steps' handles when a layer's backward is done,
    # ``LayerStep.backward_done``) -- and it prefetches no next input; the second layer's backward has the prefetch
    # and all gradients but the first layer's
    kept_first = share.kept + share.rounding
    bwd_first = layer_bwd(0.0) - (prefetch - pre_phase)
    # a segment's top layer (host checkpoints every k >= 3 layers) holds the re-made inputs of the layers below it
    # and prefetches nothing
    bwd = max(bwd, bwd_first + share.remade)
    acts = {
        "layer forward": layers_kept + share.staging
        + T.layer_forward(cfg, dims, chunk, share.no_graph, share.pre_no_graph_tokens) + shared + on_host,
        "head forward": layers_kept + (final - softmax) + T.head_forward(cfg, dims) + shared + on_host,
        "head backward": layers_kept + final + T.head_backward(cfg, dims) + shared + on_host,
        "layer backward": layers_kept + bwd,
        "first layer backward": kept_first + bwd_first,
        "second layer backward": kept_first + bwd,
    }
    act_peak_formula = max(acts.values())
    act_peak = activation_peak_override if activation_peak_override is not None else act_peak_formula
    scale = act_peak / act_peak_formula if act_peak_formula else 1.0
    frag = share.fragmentation * act_peak
    accum = ms["grads"] if dims.micro_batches > 1 or ms["persistent_grads"] else 0.0
    kept = kernel_workspaces(dims)  # cuBLAS's and NCCL's, held from the first matmul and collectives on
    static = ms["params"] + ms["optimizer"] + kept
    head_units = ms.get("head_gathered", 0.0)  # FSDP2: the gathered embedding / head weights
    bwd_grads = accum or ms.get("last_layer_grads", ms["head_grad"] + ms["layer_grad"])
    # every layer's gradients (FSDP2: the shards + one layer unsharded)
    all_grads = accum or min(ms["grads"] + ms["layer_grad"], ms["head_grad"] + dims.num_layers * ms["layer_grad"])
    all_but_one = accum or all_grads - ms["layer_grad"]
    # autocast's cache ends with the forward (training/loop.py); the bf16 weights autograd saved are freed with each
    # layer's backward: by the first layer's, one layer's copies are left
    copies_first = min(ms["autocast_copies"], ms["layer_grad"] / 2)
    rounding = share.rounding
    phases = {
        "layer forward": static + ms["autocast_copies"] + accum + acts["layer forward"] * scale + frag,
        "head forward": static + head_units + ms["autocast_copies"] + accum + acts["head forward"] * scale + frag,
        "head backward": static + head_units + ms["autocast_copies"] + max(accum, ms["head_grad"])
        + acts["head backward"] * scale + frag,
        "layer backward": static + frag + max(
            ms["autocast_copies"] + bwd_grads + acts["layer backward"] * scale,
            copies_first + all_grads + acts["first layer backward"] * scale,
            copies_first + all_but_one + acts["second layer backward"] * scale),
        "optimizer": static + ms["grads"] + rounding + on_host
        + T.optimizer_step(dims, ms["numels"], ms["state_numel"]),
        "setup": setup_bytes(ms, share, shared, on_host, acts["layer backward"] * scale + bwd_grads),
    }
    peak_phase = max(phases, key=phases.get)
    parts = {"parameters": ms["params"], "gradients": ms["grads"],
             "optimizer states (+ master weights)": ms["optimizer"],
             "autocast bf16 weight copies": ms["autocast_copies"],
             "kept activations (all layers)": dims.num_layers * share.kept,
             "rounding buffers (Memo)": rounding, "final norm + head kept": final,
             "activation peak (at its moment)": act_peak, "fragmentation reserve": frag,
             "kernel workspaces (cuBLAS, NCCL)": kept}
    ranks_per_node = min(hw.gpus_per_node, dims.world)
    return MemoryEstimate(parts=parts, phases=phases, peak=phases[peak_phase], peak_phase=peak_phase,
                          capacity=hw.device_bytes, host_per_rank=host_rank, host_per_node=host_rank * ranks_per_node,
                          host_capacity=hw.host_bytes_per_node, alpha=share.alpha, layer_items=list(share.items),
                          notes=list(share.notes), fragmentation=frag,
                          optimizer_states=ms["optimizer"])
