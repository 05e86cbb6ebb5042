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

Per-layer kept tensors depend on the memory features (``memory.*``):
``none``/``selective`` keep all skeletal tensors; ``recompute_granularity: full`` keeps the layer input and the
attention output (+ lse) and rematerialises the rest at the layer's backward; ``activation_offload: memo``
keeps nothing per layer on the device: two rounding buffers hold the kept skeletal tensors (input + attention
output + α·others) of the layers in flight, the dropped (1-α)·others are rematerialised during one layer's
backward (memory/offload.py; the paper's buffers hold 2·(input + attention + others)), and host memory gets the
kept bytes of n-2 layers; ``activation_offload: checkpoints`` keeps each layer's input on the host and re-runs the
whole layer in its backward. ``memory.layer_chunk_size`` runs those re-runs in mini-sequences: what stays whole and
what one chunk holds is in docs/estimator.md ("Layer re-run in mini-sequences").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import Config, ConfigError
from ..device import HostPool
from ..memory.memo.alpha import AlphaInputs
from ..memory.memo.alpha import bounds as alpha_bounds
from . import transient as T
from .hardware import HardwareProfile
from .inventory import Dims, final_skeletal, group_bytes, layer_chunk_share, layer_skeletal, mst_head_chunk, \
    mst_mlp_chunk, qkv_local_bytes, qkv_rerun_bytes, shared_skeletal
from .states import model_state_bytes


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


def solve_alpha(s_input: float, s_attn: float, s_others: float, pcie_bytes_per_s: float, t_layer: float,
                n_layers: int, host_bytes_per_rank: float) -> tuple[float, str]:
    """The Memo LP (``memory/memo/alpha.py``, one home) for estimated sizes: max alpha s.t. the layer's copy hides
    under its forward and the n-2 swapped layers fit in this rank's host budget. Unlike training, a host budget
    that fails even at alpha = 0 is not an error here: alpha = 0 and the estimate reports out of host memory.
    Returns (alpha, binding constraint)."""
    if s_others <= 0:
        return 1.0, "nothing else to offload"
    by_bw, by_host = alpha_bounds(AlphaInputs(s_input=s_input, s_attn=s_attn, s_others=s_others,
                                              bandwidth=pcie_bytes_per_s, t_layer=t_layer, num_layers=n_layers,
                                              host_budget=host_bytes_per_rank))
    alpha = min(1.0, by_bw, by_host)
    why = "alpha = 1" if alpha == 1.0 else ("PCIe bandwidth" if by_bw <= by_host else "host memory")
    return max(0.0, alpha), why


def setup_bytes(cfg: Config, x: Dims, ms: dict, full: float, shared: float, rounding: float, on_host: float,
                step_backward: float) -> float:
    """What setup holds at its peak (``training/setup.py``): the parameters (FSDP2: the shards and one gathered
    layer -- sharding comes before anything large lands on the device), no gradient and no optimizer state yet,
    and the largest probe: Memo's calibration runs layer 0 with every token kept (its whole skeletal set and its
    forward's working set; the rounding buffers are allocated after it), FPDT's runs one block forward and backward
    (that layer's backward), ``memory.plan: auto`` traces a micro-batch's forward and backward."""
    mem = cfg.memory
    probe = rounding
    if mem.activation_offload == "memo":
        probe = max(probe, full + T.layer_forward(cfg, x))
    if x.fpdt and mem.fpdt_offload:
        probe = max(probe, full + T.layer_backward(cfg, x))
    if mem.plan == "auto":
        probe = max(probe, step_backward)
    return ms["params"] + shared + on_host + probe


def estimate_memory(cfg: Config, x: Dims, hw: HardwareProfile, t_layer_fwd: float,
                    activation_peak_override: Optional[float] = None, states: str = "framework",
                    recompute_style: str = "token_wise") -> MemoryEstimate:
    """Device peak per rank and host memory per node for ``cfg`` on ``hw`` (``t_layer_fwd``: one layer's forward
    seconds, used to solve α when ``memory.offload_fraction`` is ``auto``). ``activation_peak_override``: the
    activation peak from a memory plan or trace (replaces the formulas for activations). ``states``: a preset of
    ``states.py`` (``framework`` = this trainer; the others are what-ifs for comparing with the papers).
    ``recompute_style``: ``token_wise`` (this framework: attention output kept, never recomputed) or ``checkpoint``
    (a what-if for the papers' baselines: classic activation checkpointing keeps only each layer's input and reruns
    the whole layer, attention included; with ``activation_offload: memo`` and α = 0 the inputs go to the host,
    DeepSpeed's "checkpoint with CPU offload")."""
    if recompute_style not in ("token_wise", "checkpoint"):
        raise ConfigError(f"recompute_style must be token_wise or checkpoint, got {recompute_style!r}")
    mem = cfg.memory
    fpdt = x.fpdt
    mlp_chunked = mst_mlp_chunk(cfg, x) is not None
    head_chunked = mst_head_chunk(cfg, x) is not None
    token_wise = mem.token_wise
    ckpt_chunks = (mem.activation_offload == "checkpoints" and recompute_style == "token_wise"
                   and layer_chunk_share(cfg, x) is not None)
    # the chunked checkpoints mode assembles q, k, v whole, like the token-wise slot (memory/chunked_layer.py)
    items = layer_skeletal(x, mlp_chunked, mem.fpdt_offload and fpdt, token_wise or ckpt_chunks)
    g = group_bytes(items)
    full = sum(g.values())
    notes: list[str] = []

    # ---- what each layer keeps on the device, and the rounding buffers -------------------------------------
    alpha: Optional[float] = None
    rounding = staging = 0.0
    no_graph = 0.0  # the share of the tokens re-run in backward (their post runs without autograd in the forward)
    ms = model_state_bytes(cfg, x, states)
    states_host = ms.get("host", 0.0)  # FSDP2 with CPU offload: shards, gradients, AdamW states
    host_rank = states_host
    fpdt_host = 0.0
    if fpdt and mem.fpdt_offload:  # before Memo's LP: its host budget is what the rest leaves
        # per layer on the host until its backward: the projection's saved chunk inputs, q^, k^, v^, o^, lse
        kv = x.kv_heads_after_a2a
        # (with classic checkpointing the block runs again in backward: one layer's chunks at a time)
        rerun = mem.layer_reruns_whole or (recompute_style == "checkpoint" and (
            mem.recompute_granularity == "full" or mem.activation_offload == "memo"))
        layers = 1 if rerun else x.L
        fpdt_host += layers * x.tokens * (x.h * x.act + (2 * x.nq_l + 2 * kv) * x.d * x.act + x.nq_l * 4)
        # the host pool also holds one backward's do^ and fp32 dq chunks (attention/fpdt/calibrate.py: L * F + B),
        # and rounds each parked view up to HostPool.ALIGN (per chunk: ~6 per layer, 2 for the backward)
        fpdt_host += x.tokens * x.nq_l * x.d * (x.act + 4) + (6 * layers + 2) * x.fpdt_chunks * HostPool.ALIGN
    if mem.activation_offload == "memo":
        ranks_per_node = min(hw.gpus_per_node, x.world)
        host_share = hw.host_bytes_per_node / ranks_per_node - host_rank - fpdt_host
        if mem.offload_fraction == "auto":
            alpha, why = solve_alpha(g["input"], g["attn"], g["others"], hw.pcie_gbps * 1e9, t_layer_fwd, x.L,
                                     host_share)
            notes.append(f"alpha = {alpha:.3f} (LP of Memo §4.1; binding: {why})")
        else:
            alpha = float(mem.offload_fraction)
        keep = 0.0
        kept = g["input"] + g["attn"] + alpha * g["others"]
        # memory/offload.py: two buffers of the kept bytes (+ 32 aligned groups); the dropped tokens' tensors are
        # rematerialised into autograd's allocations during one layer's backward. Kept tensors are copied into the
        # buffer as autograd saves them (memory/slots.py), so no whole-layer staging copy exists (staging = 0).
        rounding = 2 * (kept + 32 * 256)
        host_rank += max(x.L - 2, 0) * kept
        recompute, no_graph = (1.0 - alpha) * g["others"], 1.0 - alpha
        if recompute_style == "checkpoint":  # only the layer inputs leave; everything else is recomputed
            alpha, kept = 0.0, g["input"]
            rounding, staging = 2 * kept, kept
            host_rank = states_host + max(x.L - 2, 0) * kept
            recompute, no_graph = full - kept, 1.0
            notes.append("what-if: checkpoint + CPU offload of layer inputs (recompute_style=checkpoint)")
    elif mem.activation_offload == "checkpoints":  # memory/checkpoint_offload.py
        # nothing per layer on the device; the input leaves while the next layer computes (staging); a layer's
        # backward re-runs it whole (its skeletal tensors) with the next layer's input already prefetched
        keep, staging = 0.0, g["input"]
        recompute, no_graph = full + g["input"], 1.0
        host_rank += x.L * g["input"]
    elif mem.recompute_granularity == "full":
        keep = g["input"] + (g["attn"] if recompute_style == "token_wise" else 0.0)
        recompute, no_graph = full - keep, 1.0
    else:
        keep = full
        recompute = 0.0
    host_rank += fpdt_host
    on_host = host_rank if hw.device == "cpu" else 0.0  # on CPU "host" copies live in the same memory

    # ---- the re-run in mini-sequences (memory.layer_chunk_size) --------------------------------------------
    # share: one mini-sequence's share of the rank's tokens; chunk_saved: what its re-run saves for its backward
    share = layer_chunk_share(cfg, x, alpha or 0.0) if no_graph and recompute_style == "token_wise" else None
    chunk_saved = attn_saved = 0.0
    pre_tokens = no_graph * x.tokens  # pre without autograd in the forward: the dropped tokens at once
    if share is not None:
        qkv = qkv_local_bytes(x)
        # MsT chunks the MLP inside a mini-sequence only when the mini-sequence is longer than its chunk
        rerun_items = layer_skeletal(x, mst_mlp_chunk(cfg, x, share * x.tokens) is not None, False, True)
        chunk_saved = share * (group_bytes(rerun_items)["others"] - qkv)
        if mem.activation_offload == "checkpoints":  # memory/chunked_layer.py
            # the fetched input, q, k, v (assembled chunk by chunk), out and lse stay whole; the next layer's input
            # is prefetched once the attention backward is done (``T.layer_backward``'s pre phase)
            recompute = g["input"] + qkv + g["attn"]
            pre_tokens = share * x.tokens
        else:  # memory/memo/steps.py: the dropped tokens' q, k, v, recomputed whole without a graph after their post
            recompute, attn_saved = 0.0, no_graph * qkv_rerun_bytes(x)

    # ---- the four moments ----------------------------------------------------------------------------------
    final = sum(i.bytes for i in final_skeletal(x, head_chunked))
    softmax = 0.0 if head_chunked else x.tokens * x.V_l * 4.0
    shared = sum(i.bytes for i in shared_skeletal(x)) + x.n_micro * x.tokens * 28.0  # + the micro-batches
    layers_kept = x.L * keep + rounding
    chunk = None if share is None else share * x.tokens  # tokens through the linears per mini-sequence
    # the re-run through the core attention's (out, lse) pair: token-wise recompute, Memo, the chunked checkpoints
    rerun = no_graph if recompute_style == "token_wise" and (token_wise or share is not None) else None
    if rerun is not None and chunk is None and not fpdt:
        recompute = 0.0  # the re-run's own tensors, moment by moment (``T.tokenwise_backward``)
    # the next layer's input, prefetched during a layer's backward (checkpoints): at its start unchunked (in
    # ``recompute``), after the attention backward in mini-sequences (``T.layer_backward``'s pre phase)
    prefetch = g["input"] if mem.activation_offload == "checkpoints" and x.L > 1 else 0.0
    pre_phase = prefetch if share is not None else 0.0

    def layer_bwd(pre_prefetch: float) -> float:
        return (recompute + T.layer_backward(cfg, x, rerun, chunk, chunk_saved, attn_saved, pre_prefetch) + shared
                + on_host)

    bwd = layer_bwd(pre_phase)
    # the first layer's backward (the last to run) has every layer's gradients; the layers after it have freed
    # their kept tensors (token-wise recompute drops its steps' handles when a layer's backward is done,
    # ``LayerStep.backward_done``) -- and it prefetches no next input; the second layer's backward has the prefetch
    # and all gradients but the first layer's
    kept_first = keep + rounding
    bwd_first = layer_bwd(0.0) - (prefetch - pre_phase)
    acts = {
        "layer forward": layers_kept + staging + T.layer_forward(cfg, x, chunk, no_graph, pre_tokens) + shared
        + on_host,
        "head forward": layers_kept + (final - softmax) + T.head_forward(cfg, x) + shared + on_host,
        "head backward": layers_kept + final + T.head_backward(cfg, x) + shared + on_host,
        "layer backward": layers_kept + bwd,
        "first layer backward": kept_first + bwd_first,
        "second layer backward": kept_first + bwd,
    }
    act_peak_formula = max(acts.values())
    act_peak = activation_peak_override if activation_peak_override is not None else act_peak_formula
    scale = act_peak / act_peak_formula if act_peak_formula else 1.0
    frag = 0.0
    if hw.device == "cuda" and mem.plan == "off" and activation_peak_override is None:
        frag = 0.10 * act_peak  # caching allocator: reserved but unusable (fragmentation); Memo §3.3, Table 4
        notes.append("fragmentation reserve 10% of activations (memory.plan: off)")
    accum = ms["grads"] if x.n_micro > 1 or ms["persistent_grads"] else 0.0
    static = ms["params"] + ms["optimizer"]
    head_units = ms.get("head_gathered", 0.0)  # FSDP2: the gathered embedding / head weights
    bwd_grads = accum or ms.get("last_layer_grads", ms["head_grad"] + ms["layer_grad"])
    # every layer's gradients (FSDP2: the shards + one layer unsharded)
    all_grads = accum or min(ms["grads"] + ms["layer_grad"], ms["head_grad"] + x.L * ms["layer_grad"])
    all_but_one = accum or all_grads - ms["layer_grad"]
    # autocast's cache ends with the forward (training/loop.py); the bf16 weights autograd saved are freed with each
    # layer's backward: by the first layer's, one layer's copies are left
    copies_first = min(ms["autocast_copies"], ms["layer_grad"] / 2)
    phases = {
        "layer forward": static + ms["autocast_copies"] + accum + acts["layer forward"] * scale + frag,
        "head forward": static + head_units + ms["autocast_copies"] + accum + acts["head forward"] * scale + frag,
        "head backward": static + head_units + ms["autocast_copies"] + max(accum, ms["head_grad"])
        + acts["head backward"] * scale + frag,
        "layer backward": static + frag + max(
            ms["autocast_copies"] + bwd_grads + acts["layer backward"] * scale,
            copies_first + all_grads + acts["first layer backward"] * scale,
            copies_first + all_but_one + acts["second layer backward"] * scale),
        "optimizer": static + ms["grads"] + rounding + on_host + T.optimizer_step(x, ms["numels"], ms["state_numel"]),
        "setup": setup_bytes(cfg, x, ms, full, shared, rounding, on_host, acts["layer backward"] * scale + bwd_grads),
    }
    peak_phase = max(phases, key=phases.get)
    parts = {"parameters": ms["params"], "gradients": ms["grads"],
             "optimizer states (+ master weights)": ms["optimizer"],
             "autocast bf16 weight copies": ms["autocast_copies"], "kept activations (all layers)": x.L * keep,
             "rounding buffers (Memo)": rounding, "final norm + head kept": final,
             "activation peak (at its moment)": act_peak, "fragmentation reserve": frag}
    ranks_per_node = min(hw.gpus_per_node, x.world)
    return MemoryEstimate(parts=parts, phases=phases, peak=phases[peak_phase], peak_phase=peak_phase,
                          capacity=hw.device_bytes, host_per_rank=host_rank, host_per_node=host_rank * ranks_per_node,
                          host_capacity=hw.host_bytes_per_node, alpha=alpha, layer_items=items, notes=notes,
                          fragmentation=frag, optimizer_states=ms["optimizer"])
