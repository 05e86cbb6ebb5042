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


def layer_comm(cfg: Config, dims: Dims, hw: HardwareProfile, attn_fwd_s: float, attn_bwd_s: float) -> dict:
    """Exposed communication seconds of one layer, forward and backward."""
    a, d = dims.compute_bytes, dims.head_dim
    out = {"tp_fwd": 0.0, "tp_bwd": 0.0, "cp_fwd": 0.0, "cp_bwd": 0.0, "host_fwd": 0.0, "host_bwd": 0.0}
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
    if dims.fpdt and cfg.memory.fpdt_offload:
        n = dims.fpdt_chunks
        pcie = hw.pcie_gbps * 1e9
        kv_chunk = 2 * dims.tokens / n * kv * d * a
        nq = dims.heads_local
        q_chunk = dims.tokens / n * (3 * nq * d * a + nq * 4 + 2 * nq * d * 4)  # q, out, dout, lse, dq r/w
        save = dims.tokens * ((2 * dims.heads_local + 2 * kv) * d * a + dims.heads_local * 4)
        fwd_bytes = save + n * (n - 1) / 2 * kv_chunk
        bwd_bytes = n * kv_chunk + n * (n + 1) / 2 * q_chunk
        out["host_fwd"] = max(0.0, fwd_bytes / pcie - attn_fwd_s) + kv_chunk / pcie
        out["host_bwd"] = max(0.0, bwd_bytes / pcie - attn_bwd_s) + (kv_chunk + q_chunk) / pcie
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


def estimate_time(cfg: Config, dims: Dims, hw: HardwareProfile, alpha: Optional[float],
                  recompute_style: str = "token_wise") -> TimeEstimate:
    """Seconds of one optimizer step of ``cfg`` (all micro-batches) on ``hw``."""
    mem, eff = cfg.memory, hw.efficiency
    peak = hw.peak_flops(bf16=dims.compute_bytes == 2)
    lf = layer_flops(dims)
    lin_f = lf.linear_fwd / (peak * eff.gemm)
    att_f = lf.attn_fwd / (peak * eff.attention_fwd)
    att_b = 2.5 * lf.attn_fwd / (peak * eff.attention_bwd)
    scale = 1.0
    if hw.layer_forward_seconds is not None:
        scale = hw.layer_forward_seconds / (lin_f + att_f)
        lin_f, att_f, att_b = lin_f * scale, att_f * scale, att_b * scale
    lin_b = 2 * lin_f
    comm = layer_comm(cfg, dims, hw, att_f, att_b)
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
    mlp_chunked = mst_mlp_chunk(cfg, dims) is not None
    if mlp_chunked:
        nq, nkv, d, f = dims.heads_local, dims.kv_heads_local, dims.head_dim, dims.ffn_local
        mlp_share = (3 if dims.swiglu else 2) * f / ((nq + 2 * nkv) * d + nq * d + (3 if dims.swiglu else 2) * f)
        recompute += mlp_share * lin_f  # each chunk's intermediates are recomputed in its backward
    offloaded = 0.0  # bytes of one layer that cross PCIe each way, hidden under the layer's compute
    if mem.activation_offload == "memo":
        g = group_bytes(layer_skeletal(dims, mlp_chunked, False, token_wise=True))
        offloaded = g["input"] + g["attn"] + (alpha or 0.0) * g["others"]
    elif mem.activation_offload == "checkpoints":  # the layer input alone
        offloaded = group_bytes(layer_skeletal(dims, mlp_chunked, False, token_wise=False))["input"]
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
        "host transfers (exposed)": dims.micro_batches * (dims.num_layers * (comm["host_fwd"] + comm["host_bwd"])
                                                          + n_swapped * stall),
        "gradient sync" + (" + FSDP2 gathers (exposed)" if cfg.parallel.use_torch_fsdp2 else ""): sync,
        "optimizer": opt,
    }
    step = dims.micro_batches * micro + sync + opt
    gbs = dims.micro_batches * dims.micro_batch * dims.dp
    model_flops = gbs * model_flops_per_sample(dims)
    return TimeEstimate(parts=parts, step_seconds=step,
                        tokens_per_gpu_per_s=gbs * dims.seq_length / (step * dims.world),
                        mfu=model_flops / (step * dims.world * peak), t_layer_fwd=fwd, model_flops_per_step=model_flops)
