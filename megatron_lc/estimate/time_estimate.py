"""Step time, tokens per GPU per second and MFU of a layout.

Per rank and micro-batch, per layer: compute time = FLOPs / (peak x efficiency) for the linears (gemm), the
attention forward and backward (FlashAttention's backward does 2.5x the forward FLOPs); communication time = bytes
/ effective bandwidth of the group's link (NVLink inside a node, InfiniBand across). Overlap rules:

* TP / SP collectives (all-gather, reduce-scatter or all-reduce around every linear pair): not overlapped.
* Ring (p2p): step i's k/v transfer overlaps step i's attention block; exposed = (ring-1) x max(0, comm - compute)
  per step, forward (k, v) and backward (k, v and fp32 dk, dv).
* Ulysses (a2a): the all-to-alls before and after attention are not overlapped.
* FPDT: chunked all-to-alls as Ulysses; host<->device chunk traffic overlaps the layer's attention compute, one
  chunk's transfer is exposed (pipeline fill).
* Memo offload: layer i's copy to host overlaps layer i+1's forward, the prefetch overlaps layer i+1's backward;
  only the excess stalls (n-2 layers). Dropped tokens (1-α) of the token-wise part are recomputed.
* Recompute full: the token-wise part of each layer runs twice (attention is kept: memory/memo); selective: core
  attention's forward runs twice. MsT: MLP and head forward rerun per chunk in backward.
* Gradient all-reduce over dp x cp (+ ZeRO-1's parameter broadcast) after the last micro-batch: not overlapped.

``hardware.layer_forward_seconds`` (measured by the Memo profiler) replaces the computed compute time of a layer's
forward; the backward and recompute are scaled by the same factor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..config import Config
from .flops import head_flops_fwd, layer_flops, model_flops_per_sample
from .hardware import HardwareProfile
from .inventory import Dims, group_bytes, layer_skeletal, mst_mlp_chunk, param_shards


@dataclass
class TimeEstimate:
    parts: dict  # seconds per step by part
    step_seconds: float
    tokens_per_gpu_per_s: float
    mfu: float
    t_layer_fwd: float  # one layer's forward (compute + exposed communication), per micro-batch
    model_flops_per_step: float


def _bw(hw: HardwareProfile, size: int, stride: int) -> float:
    return hw.link_bytes_per_s(size, stride)


def layer_comm(cfg: Config, x: Dims, hw: HardwareProfile, attn_fwd_s: float, attn_bwd_s: float) -> dict:
    """Exposed communication seconds of one layer, forward and backward."""
    a, d = x.act, x.d
    out = {"tp_fwd": 0.0, "tp_bwd": 0.0, "cp_fwd": 0.0, "cp_bwd": 0.0, "host_fwd": 0.0, "host_bwd": 0.0}
    if x.tp > 1:
        vol = 4 * (x.tp - 1) / x.tp * x.tokens * x.h * a  # 2 AG + 2 RS (SP) or 2 all-reduces, each way
        out["tp_fwd"] = out["tp_bwd"] = vol / _bw(hw, x.tp, 1)
    u, ring = x.ulysses if x.uses_a2a else 1, x.cp // (x.ulysses if x.uses_a2a else 1)
    kv = x.kv_heads_after_a2a
    if u > 1:
        vol = (u - 1) / u * x.tokens * (2 * x.nq_l + 2 * kv) * d * a  # q, k, v there, out back
        out["cp_fwd"] += vol / _bw(hw, u, x.tp)
        out["cp_bwd"] += vol / _bw(hw, u, x.tp)
    if ring > 1 and x.cp_type in ("p2p", "a2a+p2p"):
        bw = _bw(hw, ring, x.tp * u)
        kv_bytes = 2 * x.tokens * kv * d * a
        step_f, step_b = attn_fwd_s / ring, attn_bwd_s / ring
        out["cp_fwd"] += (ring - 1) * max(0.0, kv_bytes / bw - step_f)
        out["cp_bwd"] += (ring - 1) * max(0.0, (kv_bytes + 2 * x.tokens * kv * d * 4) / bw - step_b)
    if x.fpdt and cfg.memory.fpdt_offload:
        n = x.fpdt_chunks
        pcie = hw.pcie_gbps * 1e9
        kv_chunk = 2 * x.tokens / n * kv * d * a
        q_chunk = x.tokens / n * (3 * x.nq_l * d * a + x.nq_l * 4 + 2 * x.nq_l * d * 4)  # q, out, dout, lse, dq r/w
        save = x.tokens * ((2 * x.nq_l + 2 * kv) * d * a + x.nq_l * 4)
        fwd_bytes = save + n * (n - 1) / 2 * kv_chunk
        bwd_bytes = n * kv_chunk + n * (n + 1) / 2 * q_chunk
        out["host_fwd"] = max(0.0, fwd_bytes / pcie - attn_fwd_s) + kv_chunk / pcie
        out["host_bwd"] = max(0.0, bwd_bytes / pcie - attn_bwd_s) + (kv_chunk + q_chunk) / pcie
    return out


HOST_ADAM_GBPS = 20.0  # effective host memory bandwidth of torch's CPU AdamW (an assumption, never measured here)


def fsdp_exposed_seconds(cfg: Config, x: Dims, hw: HardwareProfile, numel: float, micro: float) -> float:
    """FSDP2's communication per step that compute does not hide: per micro-batch every weight is all-gathered twice
    (forward, backward; compute dtype) and its gradient reduce-scattered (fp32) over dp x cp -- prefetched one
    layer ahead, so only what exceeds the micro-batch's compute is exposed; with CPU offload the shards also cross
    PCIe (fp32 to the device twice, gradients back)."""
    n = x.dp * x.cp
    vol = (n - 1) / n * numel * (2 * x.act + 4) if n > 1 else 0.0
    secs = vol / _bw(hw, n, x.tp) if n > 1 else 0.0
    if cfg.parallel.fsdp_cpu_offload:
        secs += 3 * 4 * numel / n / (hw.pcie_gbps * 1e9)
    return x.n_micro * max(0.0, secs - micro)


def estimate_time(cfg: Config, x: Dims, hw: HardwareProfile, alpha: Optional[float],
                  recompute_style: str = "token_wise") -> TimeEstimate:
    """Seconds of one optimizer step of ``cfg`` (all micro-batches) on ``hw``."""
    mem, eff = cfg.memory, hw.efficiency
    peak = hw.peak_flops(bf16=x.act == 2)
    lf = layer_flops(x)
    lin_f = lf.linear_fwd / (peak * eff.gemm)
    att_f = lf.attn_fwd / (peak * eff.attention_fwd)
    att_b = 2.5 * lf.attn_fwd / (peak * eff.attention_bwd)
    scale = 1.0
    if hw.layer_forward_seconds is not None:
        scale = hw.layer_forward_seconds / (lin_f + att_f)
        lin_f, att_f, att_b = lin_f * scale, att_f * scale, att_b * scale
    lin_b = 2 * lin_f
    comm = layer_comm(cfg, x, hw, att_f, att_b)
    fwd = lin_f + att_f + comm["tp_fwd"] + comm["cp_fwd"] + comm["host_fwd"]
    bwd = lin_b + att_b + comm["tp_bwd"] + comm["cp_bwd"] + comm["host_bwd"]
    recompute = 0.0
    if mem.activation_offload == "memo":
        a = alpha if alpha is not None else 0.0
        recompute = (1.0 - a) * (lin_f + comm["tp_fwd"])
    elif mem.recompute_granularity == "full":
        recompute = lin_f + comm["tp_fwd"]
    if mem.activation_offload == "checkpoints" or (recompute_style == "checkpoint" and (
            mem.recompute_granularity == "full" or mem.activation_offload == "memo")):
        recompute = lin_f + att_f + comm["tp_fwd"] + comm["cp_fwd"]  # the whole layer again, attention included
    elif mem.recompute_granularity == "selective":
        recompute = att_f
    mlp_chunked = mst_mlp_chunk(cfg, x) is not None
    if mlp_chunked:
        mlp_share = (3 if x.swiglu else 2) * x.f_l / ((x.nq_l + 2 * x.nkv_l) * x.d + x.nq_l * x.d
                                                     + (3 if x.swiglu else 2) * x.f_l)
        recompute += mlp_share * lin_f  # each chunk's intermediates are recomputed in its backward
    offloaded = 0.0  # bytes of one layer that cross PCIe each way, hidden under the layer's compute
    if mem.activation_offload == "memo":
        g = group_bytes(layer_skeletal(x, mlp_chunked, False, token_wise=True))
        offloaded = g["input"] + g["attn"] + (alpha or 0.0) * g["others"]
    elif mem.activation_offload == "checkpoints":  # the layer input alone
        offloaded = group_bytes(layer_skeletal(x, mlp_chunked, False, token_wise=False))["input"]
    xfer = offloaded / (hw.pcie_gbps * 1e9)
    stall = max(0.0, xfer - fwd) + max(0.0, xfer - (bwd + recompute)) if offloaded else 0.0
    n_swapped = max(x.L - 2, 0)
    head_f = head_flops_fwd(x) / (peak * eff.gemm) * scale
    head = 3 * head_f  # MsT's head computes its gradient in forward: no recompute (memory/mst/head_function.py)
    micro = x.L * (fwd + bwd + recompute) + n_swapped * stall + head
    # gradient sync over dp x cp (fp32, ring all-reduce), ZeRO-1 parameter broadcast, AdamW (memory bound)
    numel = sum(n for _, n, _ in param_shards(x))
    n = x.dp * x.cp
    sync = 2 * (n - 1) / n * 4 * numel / _bw(hw, n, x.tp) if n > 1 else 0.0
    if cfg.parallel.use_torch_fsdp2:
        sync, owned = fsdp_exposed_seconds(cfg, x, hw, numel, micro), numel / n
    elif cfg.parallel.use_distributed_optimizer and n > 1:
        sync += (n - 1) / n * 4 * numel / _bw(hw, n, x.tp)
        owned = numel / n
    else:
        owned = numel
    opt = (28 * owned + 8 * numel) / (hw.hbm_gbps * 1e9)
    if cfg.parallel.use_torch_fsdp2 and cfg.parallel.fsdp_cpu_offload:
        opt = 28 * owned / (HOST_ADAM_GBPS * 1e9)  # AdamW on the host shards (assumed, unmeasured)
    parts = {
        "forward compute": x.n_micro * x.L * (lin_f + att_f) + x.n_micro * head_f,
        "backward compute": x.n_micro * x.L * (lin_b + att_b) + x.n_micro * 2 * head_f,
        "recompute": x.n_micro * x.L * recompute,
        "tp communication": x.n_micro * x.L * (comm["tp_fwd"] + comm["tp_bwd"]),
        "cp communication (exposed)": x.n_micro * x.L * (comm["cp_fwd"] + comm["cp_bwd"]),
        "host transfers (exposed)": x.n_micro * (x.L * (comm["host_fwd"] + comm["host_bwd"]) + n_swapped * stall),
        "gradient sync" + (" + FSDP2 gathers (exposed)" if cfg.parallel.use_torch_fsdp2 else ""): sync,
        "optimizer": opt,
    }
    step = x.n_micro * micro + sync + opt
    gbs = x.n_micro * x.b * x.dp
    model_flops = gbs * model_flops_per_sample(x)
    return TimeEstimate(parts=parts, step_seconds=step, tokens_per_gpu_per_s=gbs * x.s / (step * x.world),
                        mfu=model_flops / (step * x.world * peak), t_layer_fwd=fwd, model_flops_per_step=model_flops)
