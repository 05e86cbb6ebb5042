"""Step time, tokens per GPU per second and MFU of a layout.

Per rank and micro-batch, per layer: compute time = FLOPs / (peak x efficiency) for the linears (gemm), the
attention forward and backward (FlashAttention's backward does 2.5x the forward FLOPs); communication time = bytes
/ effective bandwidth of the group's link (NVLink inside a node, InfiniBand across). Overlap rules:

* TP / SP collectives (all-gather, reduce-scatter or all-reduce around every linear pair): not overlapped.
* Ring (p2p): step i's k/v transfer overlaps step i's attention block; exposed = (ring-1) x max(0, comm - compute)
  per step, forward (k, v) and backward (k, v and fp32 dk, dv).
* Ulysses (a2a): the all-to-alls before and after attention are not overlapped.
* FPDT: chunked all-to-alls as Ulysses.
* Gradient all-reduce over dp x cp (+ ZeRO-1's parameter broadcast) after the last micro-batch: not overlapped.

What the memory techniques cost is their terms' share (``terms/``, looked up by ``config.Techniques``): the
seconds a layer runs again (token-wise recompute: the token-wise part; Memo: 1 - alpha of it; selective: the
attention forward; the host checkpoints: the whole layer; MsT: the MLP's forward, chunk by chunk), the bytes a
layer copies to the host and back (Memo, the host checkpoints: hidden under the next layer's forward and backward,
the excess stalls, n - 2 layers) and FPDT's chunk traffic (overlapping the attention, one chunk exposed). This
module adds them. Example, Llama3-8B at 1M tokens on 8 H100s with Memo at alpha 0.25 and MsT: the recompute is
0.75 of the token-wise part plus the MLP's forward, 4.1 s of a 255.5 s step.

``hardware.layer_forward_seconds`` (measured by the Memo profiler) replaces the computed compute time of a layer's
forward; the backward and recompute are scaled by the same factor.

The attention efficiencies (``attention_kernel``): the backend's own, measured on the profile's GPU for the calls
the layout makes (``call_weights``: ring cp 8 = one 128K^2 causal diagonal and seven 128K x 64K blocks' worth,
FLOP-weighted), when ``bench/attention_kernels.py`` measured it (``HardwareProfile.attention_measured``); else the
profile's assumed ones. ``auto`` is the backend the run would pick on that GPU: the fastest measured for these
calls, else ``torch``. ``TimeEstimate.efficiencies`` says which is which, for the tables to print beside MFU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..attention.kernel_table import BWD_FLOPS
from ..config import Config
from . import moe
from .flops import head_flops_fwd, layer_flops, model_flops_per_sample
from .hardware import HardwareProfile
from .dims import Dims
from .inventory import param_shards
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


def attention_kernel(cfg: Config, dims: Dims, hw: HardwareProfile) -> tuple:
    """(backend, fwd, bwd, source) of the layout's attention on ``hw`` (module doc); source ``assumed`` or
    ``measured (GPU, date)``."""
    name, table, w = cfg.parallel.attention_backend, hw.attention_measured, call_weights(dims)
    if name == "auto":
        name = (table.fastest([b for b in table.backends if b != "math"], w) if table else None) or "torch"
    measured = table.efficiency(name, w) if table is not None and dims.device == "cuda" else None
    fwd, bwd, source = (*measured, table.source) if measured is not None else \
        (hw.efficiency.attention_fwd, hw.efficiency.attention_bwd, "assumed")
    return name, fwd, bwd, source


def _bw(hw: HardwareProfile, size: int, stride: int) -> float:
    return hw.link_bytes_per_s(size, stride)


def layer_comm(dims: Dims, hw: HardwareProfile, attn_fwd_s: float, attn_bwd_s: float) -> dict:
    """Exposed tp / cp communication seconds of one layer, forward and backward."""
    a, d = dims.compute_bytes, dims.head_dim
    out = {"tp_fwd": 0.0, "tp_bwd": 0.0, "cp_fwd": 0.0, "cp_bwd": 0.0}
    if dims.tp > 1:
        vol = 4 * (dims.tp - 1) / dims.tp * dims.tokens * dims.hidden * a  # 2 AG + 2 RS (SP) or 2 all-reduces, each way
        out["tp_fwd"] = out["tp_bwd"] = vol / _bw(hw, dims.tp, 1)
    u, ring = dims.ulysses if dims.uses_a2a else 1, dims.cp // (dims.ulysses if dims.uses_a2a else 1)
    kv = dims.kv_heads_after_a2a
    if u > 1:
        vol = (u - 1) / u * dims.tokens * (2 * dims.heads_local + 2 * kv) * d * a  # q, k, v there, out back
        out["cp_fwd"] += vol / _bw(hw, u, dims.tp)
        out["cp_bwd"] += vol / _bw(hw, u, dims.tp)
    if ring > 1 and dims.cp_comm_type in ("p2p", "a2a+p2p"):
        bw = _bw(hw, ring, dims.tp * u)
        kv_bytes = 2 * dims.tokens * kv * d * a
        step_f, step_b = attn_fwd_s / ring, attn_bwd_s / ring
        out["cp_fwd"] += (ring - 1) * max(0.0, kv_bytes / bw - step_f)
        out["cp_bwd"] += (ring - 1) * max(0.0, (kv_bytes + 2 * dims.tokens * kv * d * 4) / bw - step_b)
    return out


HOST_ADAM_GBPS = 20.0  # effective host memory bandwidth of torch's CPU AdamW (an assumption, never measured here)


def fsdp_exposed_seconds(cfg: Config, dims: Dims, hw: HardwareProfile, numel: float, micro: float) -> float:
    """FSDP2's communication per step that compute does not hide: per micro-batch every weight is all-gathered twice
    (forward, backward; compute dtype) and its gradient reduce-scattered (fp32) over dp x cp -- prefetched one
    layer ahead, so only what exceeds the micro-batch's compute is exposed; with CPU offload the shards also cross
    PCIe (fp32 to the device twice, gradients back)."""
    n = dims.dp * dims.cp
    vol = (n - 1) / n * numel * (2 * dims.compute_bytes + 4) if n > 1 else 0.0
    secs = vol / _bw(hw, n, dims.tp) if n > 1 else 0.0
    if cfg.parallel.fsdp_cpu_offload:
        secs += 3 * 4 * numel / n / (hw.pcie_gbps * 1e9)
    return dims.micro_batches * max(0.0, secs - micro)


def estimate_time(cfg: Config, dims: Dims, hw: HardwareProfile, terms: Terms, alpha: Optional[float]) -> TimeEstimate:
    """Seconds of one optimizer step of ``cfg`` (all micro-batches) on ``hw`` with the techniques' ``terms``
    (``terms.terms_for``); ``alpha``: Memo's offload fraction as the memory estimate chose it (None: 0)."""
    eff = hw.efficiency
    backend, eff_fwd, eff_bwd, source = attention_kernel(cfg, dims, hw)
    peak = hw.peak_flops(bf16=dims.compute_bytes == 2)
    lf = layer_flops(dims)
    lin_f = lf.linear_fwd / (peak * eff.gemm)
    att_f = lf.attn_fwd / (peak * eff_fwd)
    att_b = BWD_FLOPS * lf.attn_fwd / (peak * eff_bwd)
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
    ep_a2a = (sum(dims.moe_layers) / dims.num_layers * moe.all_to_all_bytes(dims) / _bw(hw, dims.ep, dims.tp)
              if dims.ep > 1 else 0.0)
    ep_bwd = ep_a2a * (2 if moe.remade_in_backward(cfg, dims) else 1)
    fwd = lin_f + att_f + comm["tp_fwd"] + comm["cp_fwd"] + share.host_fwd + ep_a2a
    bwd = lin_b + att_b + comm["tp_bwd"] + comm["cp_bwd"] + share.host_bwd + ep_bwd
    recompute, offloaded = share.recompute, share.offloaded
    xfer = offloaded / (hw.pcie_gbps * 1e9)
    stall = max(0.0, xfer - fwd) + max(0.0, xfer - (bwd + recompute)) if offloaded else 0.0
    n_swapped = max(dims.num_layers - 2, 0)
    head_f = head_flops_fwd(dims) / (peak * eff.gemm) * scale
    head = 3 * head_f  # MsT's head computes its gradient in forward: no recompute (memory/mst/head_function.py)
    micro = dims.num_layers * (fwd + bwd + recompute) + n_swapped * stall + head
    # gradient sync over dp x cp (fp32, ring all-reduce), ZeRO-1 parameter broadcast, AdamW (memory bound)
    numel = sum(n for _, n, _ in param_shards(dims))
    n = dims.dp * dims.cp
    sync = 2 * (n - 1) / n * 4 * numel / _bw(hw, n, dims.tp) if n > 1 else 0.0
    if dims.ep > 1:  # an expert rank's experts are summed over its n / ep expert-data ranks only
        experts = sum(k for name, k, _ in param_shards(dims) if moe.is_expert_param(name))
        m = n // dims.ep
        sync -= 2 * (n - 1) / n * 4 * experts / _bw(hw, n, dims.tp)
        sync += 2 * (m - 1) / m * 4 * experts / _bw(hw, m, dims.tp * dims.ep) if m > 1 else 0.0
    if cfg.parallel.use_torch_fsdp2:
        sync, owned = fsdp_exposed_seconds(cfg, dims, hw, numel, micro), numel / n
    elif cfg.parallel.use_distributed_optimizer and n > 1:
        sync += (n - 1) / n * 4 * numel / _bw(hw, n, dims.tp)
        owned = numel / n
    else:
        owned = numel
    opt = (28 * owned + 8 * numel) / (hw.hbm_gbps * 1e9)
    if cfg.parallel.use_torch_fsdp2 and cfg.parallel.fsdp_cpu_offload:
        opt = 28 * owned / (HOST_ADAM_GBPS * 1e9)  # AdamW on the host shards (assumed, unmeasured)
    parts = {
        "forward compute": dims.micro_batches * dims.num_layers * (lin_f + att_f) + dims.micro_batches * head_f,
        "backward compute": dims.micro_batches * dims.num_layers * (lin_b + att_b) + dims.micro_batches * 2 * head_f,
        "recompute": dims.micro_batches * dims.num_layers * recompute,
        "tp communication": dims.micro_batches * dims.num_layers * (comm["tp_fwd"] + comm["tp_bwd"]),
        "cp communication (exposed)": dims.micro_batches * dims.num_layers * (comm["cp_fwd"] + comm["cp_bwd"]),
        "expert all-to-all": dims.micro_batches * dims.num_layers * (ep_a2a + ep_bwd),
        "host transfers (exposed)": dims.micro_batches * (dims.num_layers * (share.host_fwd + share.host_bwd)
                                                          + n_swapped * stall),
        "gradient sync" + (" + FSDP2 gathers (exposed)" if cfg.parallel.use_torch_fsdp2 else ""): sync,
        "optimizer": opt,
    }
    step = dims.micro_batches * micro + sync + opt
    gbs = dims.micro_batches * dims.micro_batch * dims.dp
    model_flops = gbs * model_flops_per_sample(dims)
    effs = {"gemm": (eff.gemm, "assumed"), "attention forward": (eff_fwd, source),
            "attention backward": (eff_bwd, source)}
    if hw.layer_forward_seconds is not None:  # every efficiency scaled to the layer time the profiler measured
        effs = {k: (v / scale, f"{src}, scaled to the measured layer time") for k, (v, src) in effs.items()}
    return TimeEstimate(parts=parts, step_seconds=step,
                        tokens_per_gpu_per_s=gbs * dims.seq_length / (step * dims.world),
                        mfu=model_flops / (step * dims.world * peak), t_layer_fwd=fwd, model_flops_per_step=model_flops,
                        attention_backend=backend, efficiencies=effs)
