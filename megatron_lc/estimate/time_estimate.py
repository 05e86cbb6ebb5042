"""Step time, tokens per GPU per second and MFU of a layout.

Per rank and micro-batch, per layer: compute time = FLOPs / (peak x efficiency) for the linears (gemm), the
attention forward and backward (FlashAttention's backward does 2.5x the forward FLOPs) at the efficiencies of the
attention kernel that will run (``attention_kernel``); communication time = bytes / effective bandwidth of the
group's links (``hardware.py``: NVLink inside a node; across nodes a ring collective pools the group's NICs, an
all-to-all sends the away share through the rank's own, a ring's p2p hop is its slowest). Overlap rules:

* TP / SP collectives (all-gather, reduce-scatter or all-reduce around every linear pair): not overlapped.
* Ring (p2p): step i's k/v transfer overlaps step i's attention block; exposed = (ring-1) x max(0, comm - compute)
  per step, forward (k, v) and backward (k, v and fp32 dk, dv). The balanced layout under documents / a window
  (``parallel.cp_layout``) moves only the plan's rows (``ring_balance.py``: the slowest receiver's), hidden behind
  the R-1 blocks after the diagonal; the excess is exposed.
* Packed documents and windows on a ring: every layer waits for the slowest ring rank's attention, ``imbalance``
  times the mean (``ring_balance.py``: ~2 for the zigzag at 1M on 8 with 64K documents, 1.00 balanced).
* Ulysses (a2a): the all-to-alls before and after attention are not overlapped.
* FPDT: chunked all-to-alls as Ulysses.
* The model states' communication as the system issues it (``sync_time.py``): after the backward (this framework's
  DDP / ZeRO-1), per layer under its compute (FSDP2, ZeRO-3), under the last backward and the next forward
  (Megatron's distributed optimizer, the ``megatron`` what-if).

What the memory techniques cost is their terms' share (``terms/``, looked up by ``config.Techniques``): the
seconds a layer runs again (token-wise recompute: the token-wise part; Memo: 1 - alpha of it; selective: the
attention forward; the host checkpoints: the whole layer; MsT: its MLP chunks' re-run at the cost MsT measured),
the bytes a layer copies to the host and back (Memo, the host checkpoints: hidden under the next layer's forward and
backward, the excess stalls, n - 2 layers; every rank of the node copies at once, ``Run.host_bytes_per_s``) and
FPDT's chunk traffic (overlapping the attention, one chunk exposed). This module adds them. Example, Llama3-8B at
1M tokens on 8 H100s with Memo at alpha 0.25 and MsT, PyTorch's FA2-class attention at 0.34 / 0.33 of peak: 397.9 s
a step, MFU 29.1%; with FlashAttention-3 (0.62 / 0.57) 230.2 s, 50.2%.

``hardware.layer_forward_seconds`` (measured by the Memo profiler) replaces the computed compute time of a layer's
forward; the backward and recompute are scaled by the same factor. ``hardware.step_overhead_seconds`` adds the
loop's host work a step where the host's time is the step's (the CPU profile, fitted with its peak and attention
on the plain model at four lengths: ``bench/estimate_calibration.py --profile``; 0 on the GPU profiles).

The attention efficiencies (``attention_kernel``): the backend's own, measured on the profile's GPU for the calls
the layout makes (``call_weights``: ring cp 8 = one 128K^2 causal diagonal and seven 128K x 64K blocks' worth,
FLOP-weighted), when ``bench/attention_kernels.py`` measured it (``HardwareProfile.attention_measured``); else set by
hand; else the profile's figure for the backend with its source (published or calibrated). ``auto`` is the backend
the run would pick on that GPU: the fastest measured for these calls, else ``torch``. ``TimeEstimate.efficiencies``
says where each comes from, for the tables to print beside MFU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..attention.kernel_table import BWD_FLOPS
from ..config import Config, ConfigError
from . import moe
from .flops import head_flops_fwd, layer_flops, model_flops_per_sample
from .hardware import HardwareProfile
from .dims import Dims
from .ring_balance import ring_balance
from .sync_time import layer_numels, sync_seconds, sync_style
from .terms import LayerSeconds, Run, Terms, TimeShare


@dataclass
class TimeEstimate:
    parts: dict  # seconds per step by part
    step_seconds: float
    tokens_per_gpu_per_s: float
    mfu: float
    t_layer_fwd: float  # one layer's forward (compute + exposed communication), per micro-batch
    model_flops_per_step: float
    attention_backend: str = "torch"  # the backend whose efficiencies these are (auto resolved)
    efficiencies: dict = field(default_factory=dict)  # {"gemm": (0.70, "assumed"), "attention forward": ...}


def call_weights(dims: Dims) -> dict:
    """The layout's attention as ``kernel_table.CALL_KINDS``, weighted by FLOPs: ring of R (the hybrid's inner ring
    too) -> the causal diagonal 1/R, the off-diagonal blocks (R-1)/R; Ulysses, and one rank's whole sequence (cp 1)
    -> one full-length call; FPDT with u chunks -> diagonals 1/u, chunk pairs (u-1)/u. Rectangles of documents and
    windows run the variable-length kernel, not measured apart: the same kinds stand for them."""
    if dims.fpdt:
        u = dims.fpdt_chunks
        return {"fpdt_diagonal": 1 / u, "fpdt_block": (u - 1) / u}
    ring = dims.cp // (dims.ulysses if dims.uses_a2a else 1)
    if ring > 1 and dims.cp_comm_type in ("p2p", "a2a+p2p"):
        return {"ring_diagonal": 1 / ring, "ring_block": (ring - 1) / ring}
    return {"ulysses": 1.0}


def attention_kernel(cfg: Config, dims: Dims, hw: HardwareProfile, backend: Optional[str] = None) -> tuple:
    """(backend, fwd, bwd, source) of the layout's attention on ``hw`` (module doc). The backend: ``backend`` (a
    what-if) or the config's; ``auto`` is the fastest of the measured table, else ``torch`` (PyTorch's fused
    kernels, the FA2-class ones on a GPU). Its efficiencies, in this order: measured for these calls (source
    ``measured (GPU, date)``); set by hand for every backend (``efficiency.attention_fwd`` / ``_bwd``); the
    profile's figure for the backend (its source); else the profile's ``torch`` figure, said so."""
    name, table, w = backend or cfg.parallel.attention_backend, hw.attention_measured, call_weights(dims)
    if name == "auto":
        name = (table.fastest([b for b in table.backends if b != "math"], w) if table else None) or "torch"
    measured = table.efficiency(name, w) if table is not None and dims.device == "cuda" else None
    if measured is not None:
        return name, measured[0], measured[1], table.source
    fig = hw.attention.get(name)
    if fig is None and "torch" in hw.attention:
        torch_fig = hw.attention["torch"]
        fig = type(torch_fig)(torch_fig.fwd, torch_fig.bwd, f"no figure for {name} on {hw.name}: torch's, "
                                                            f"{torch_fig.source}")
    fwd, bwd, source = (fig.fwd, fig.bwd, fig.source) if fig is not None else (None, None, "")
    hand = hw.efficiency.attention_fwd, hw.efficiency.attention_bwd
    if hand[0] is not None or hand[1] is not None:
        fwd, bwd = hand[0] if hand[0] is not None else fwd, hand[1] if hand[1] is not None else bwd
        source = "set by hand"
    if fwd is None or bwd is None:
        raise ConfigError(f"hardware profile {hw.name} has no attention figure for backend '{name}' (nor torch's); "
                          f"known: {', '.join(sorted(hw.attention)) or 'none'}")
    return name, fwd, bwd, source


def _bw(hw: HardwareProfile, size: int, stride: int) -> float:
    """Point to point along a ring of ``size`` ranks ``stride`` apart (the ring's slowest hop)."""
    return hw.link_bytes_per_s(size, stride)


def layer_comm(dims: Dims, hw: HardwareProfile, attn_fwd_s: float, attn_bwd_s: float) -> dict:
    """Exposed tp / cp communication seconds of one layer, forward and backward."""
    a, d = dims.compute_bytes, dims.head_dim
    out = {"tp_fwd": 0.0, "tp_bwd": 0.0, "cp_fwd": 0.0, "cp_bwd": 0.0}
    if dims.tp > 1:
        vol = 4 * (dims.tp - 1) / dims.tp * dims.tokens * dims.hidden * a  # 2 AG + 2 RS (SP) or 2 all-reduces, each way
        out["tp_fwd"] = out["tp_bwd"] = vol / hw.collective_bytes_per_s(dims.tp, 1)  # NICs pooled across nodes
    u, ring = dims.ulysses if dims.uses_a2a else 1, dims.cp // (dims.ulysses if dims.uses_a2a else 1)
    kv = dims.kv_heads_after_a2a
    if u > 1:
        sent = (u - 1) / u * dims.tokens * (2 * dims.heads_local + 2 * kv) * d * a  # q, k, v there, out back
        out["cp_fwd"] += hw.all_to_all_seconds(sent, u, dims.tp)
        out["cp_bwd"] += hw.all_to_all_seconds(sent, u, dims.tp)
    bal = ring_balance(dims)
    if bal is not None and dims.cp_layout == "balanced" and dims.ranges:
        # the plan's rows, straight from their owners, during the R-1 blocks after the diagonal one
        bw, row = _bw(hw, ring, dims.tp * u), 2 * dims.micro_batch * kv * d
        out["cp_fwd"] += max(0.0, bal.rows * row * a / bw - attn_fwd_s * (ring - 1) / ring)
        out["cp_bwd"] += max(0.0, bal.rows * row * (a + 4) / bw - attn_bwd_s * (ring - 1) / ring)
    elif bal is not None:
        bw = _bw(hw, ring, dims.tp * u)
        kv_bytes = 2 * dims.tokens * kv * d * a
        step_f, step_b = attn_fwd_s / ring, attn_bwd_s / ring
        out["cp_fwd"] += (ring - 1) * max(0.0, kv_bytes / bw - step_f)
        out["cp_bwd"] += (ring - 1) * max(0.0, (kv_bytes + 2 * dims.tokens * kv * d * 4) / bw - step_b)
    return out


HOST_ADAM_GBPS = 20.0  # effective host memory bandwidth of torch's CPU AdamW (an assumption, never measured here)


def estimate_time(cfg: Config, dims: Dims, hw: HardwareProfile, terms: Terms, alpha: Optional[float],
                  states: str = "framework", backend: Optional[str] = None) -> TimeEstimate:
    """Seconds of one optimizer step of ``cfg`` (all micro-batches) on ``hw`` with the techniques' ``terms``
    (``terms.terms_for``); ``alpha``: Memo's offload fraction as the memory estimate chose it (None: 0);
    ``states``: who holds the model states (``states.py``; how their communication overlaps, ``sync_time.py``);
    ``backend``: an attention backend in place of the config's (a what-if, ``attention_kernel``)."""
    eff = hw.efficiency
    backend, eff_fwd, eff_bwd, source = attention_kernel(cfg, dims, hw, backend)
    peak = hw.peak_flops(bf16=dims.compute_bytes == 2)
    lf = layer_flops(dims)
    lin_f = lf.linear_fwd / (peak * eff.gemm)
    bal = ring_balance(dims)
    slowest = bal.imbalance if bal is not None else 1.0  # each layer waits for the slowest ring rank's attention
    att_f = slowest * lf.attn_fwd / (peak * eff_fwd)
    att_b = slowest * BWD_FLOPS * lf.attn_fwd / (peak * eff_bwd)
    scale = 1.0
    if hw.layer_forward_seconds is not None:
        scale = hw.layer_forward_seconds / (lin_f + att_f)
        lin_f, att_f, att_b = lin_f * scale, att_f * scale, att_b * scale
    lin_b = 2 * lin_f
    comm = layer_comm(dims, hw, att_f, att_b)
    run = Run(cfg, dims, hw, terms)
    share = terms.time(run, LayerSeconds(lin_f, att_f, att_b, **comm),
                       TimeShare(shape=terms.layer_shape(run), alpha=alpha))
    # expert parallelism's all-to-alls (the copies there and back, again in backward, and again when MsT re-makes
    # its chunks there), not overlapped; the mean over the layers (estimate/moe.py)
    ep_a2a = (sum(dims.moe_layers) / dims.num_layers * hw.all_to_all_seconds(moe.all_to_all_bytes(dims), dims.ep,
                                                                            dims.tp) if dims.ep > 1 else 0.0)
    ep_bwd = ep_a2a * (2 if moe.remade_in_backward(cfg, dims) else 1)
    fwd = lin_f + att_f + comm["tp_fwd"] + comm["cp_fwd"] + share.host_fwd + ep_a2a
    bwd = lin_b + att_b + comm["tp_bwd"] + comm["cp_bwd"] + share.host_bwd + ep_bwd
    recompute, offloaded = share.recompute, share.offloaded
    xfer = offloaded / run.host_bytes_per_s  # every rank of the node copies at once
    stall = max(0.0, xfer - fwd) + max(0.0, xfer - (bwd + recompute)) if offloaded else 0.0
    n_swapped = max(dims.num_layers - 2, 0)
    head_f = head_flops_fwd(dims) / (peak * eff.gemm) * scale
    head = 3 * head_f  # MsT's head computes its gradient in forward: no recompute (memory/mst/head_function.py)
    micro = dims.num_layers * (fwd + bwd + recompute) + n_swapped * stall + head
    # the model states' communication as the system issues it (sync_time.py), AdamW (memory bound)
    sync = sync_seconds(cfg, dims, hw, states, fwd, bwd + recompute, dims.num_layers * fwd + head_f,
                        dims.num_layers * (bwd + recompute) + 2 * head_f)
    numel = layer_numels(dims)[1]
    if states == "zero3":
        owned = numel / dims.world
    elif cfg.parallel.use_torch_fsdp2 or cfg.parallel.use_distributed_optimizer:
        owned = numel / (dims.dp * dims.cp)
    else:
        owned = numel
    opt = (28 * owned + 8 * numel) / (hw.hbm_gbps * 1e9)
    if cfg.parallel.use_torch_fsdp2 and cfg.parallel.fsdp_cpu_offload:
        opt = 28 * owned / (HOST_ADAM_GBPS * 1e9)  # AdamW on the host shards (assumed, unmeasured)
    states_comm = {"after_backward": "gradient sync", "per_layer": "gradient sync + gathers (exposed)",
                   "overlapped": "gradient sync (exposed)"}[sync_style(cfg, states)]
    parts = {
        "forward compute": dims.micro_batches * dims.num_layers * (lin_f + att_f) + dims.micro_batches * head_f,
        "backward compute": dims.micro_batches * dims.num_layers * (lin_b + att_b) + dims.micro_batches * 2 * head_f,
        "recompute": dims.micro_batches * dims.num_layers * recompute,
        "tp communication": dims.micro_batches * dims.num_layers * (comm["tp_fwd"] + comm["tp_bwd"]),
        "cp communication (exposed)": dims.micro_batches * dims.num_layers * (comm["cp_fwd"] + comm["cp_bwd"]),
        "expert all-to-all": dims.micro_batches * dims.num_layers * (ep_a2a + ep_bwd),
        "host transfers (exposed)": dims.micro_batches * (dims.num_layers * (share.host_fwd + share.host_bwd)
                                                          + n_swapped * stall),
        states_comm: sync,
        "optimizer": opt,
        "host work a step": hw.step_overhead_seconds,
    }
    step = dims.micro_batches * micro + sync + opt + hw.step_overhead_seconds
    gbs = dims.micro_batches * dims.micro_batch * dims.dp
    model_flops = gbs * model_flops_per_sample(dims)
    effs = {"gemm": (eff.gemm, eff.gemm_source), "attention forward": (eff_fwd, source),
            "attention backward": (eff_bwd, source)}
    if hw.layer_forward_seconds is not None:  # every efficiency scaled to the layer time the profiler measured
        effs = {k: (v / scale, f"{src}, scaled to the measured layer time") for k, (v, src) in effs.items()}
    return TimeEstimate(parts=parts, step_seconds=step,
                        tokens_per_gpu_per_s=gbs * dims.seq_length / (step * dims.world),
                        mfu=model_flops / (step * dims.world * peak), t_layer_fwd=fwd, model_flops_per_step=model_flops,
                        attention_backend=backend, efficiencies=effs)
