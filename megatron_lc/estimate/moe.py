"""The MoE layers' share of the estimate (``model/moe.py``, ``parallel/expert_parallel.py``, ``memory/mst/moe.py``):
their parameters and how expert parallelism and FSDP2 shard them, their active FLOPs, the all-to-all bytes, what
they keep for backward and what their dispatch holds briefly, for the sizes of ``dims.Dims``.

Per rank and micro-batch an MoE layer routes its R residual rows (``tokens_residual``: under sequence parallelism
each tp rank routes its own share) to k experts each: C = R k copies. Expert parallelism sends the copies to their
experts' ranks; a rank receives C' = C x ``Dims.expert_load`` rows -- dropless, the load is whatever the router
decides, so the peak assumes the imbalance ``config.moe.EXPERT_LOAD`` states (at ep 1 every copy stays: exactly C).
Per copy the layer keeps its row for the first grouped matmul, the ``[2f]`` gate and up, silu(gate) and their
product, and per token copy the experts' output row the combine saves (bytes of the compute dtype), plus the router's
softmax ``[R, E]`` fp32 and index vectors. MsT's mini-sequences keep only the block's input; one chunk's set exists at
a time, in forward and again in backward.

Example, Qwen3-30B-A3B (h 2048, 128 experts, top-8, expert width 768), 262144 rows a rank, bf16, ep 8 at load 1.25:
C = 2M copies, C' = 2.6M rows; kept without mini-sequences ~ C' (h + 4f) 2 + C h 2 + R (h 2 + E 4) = 33.1 GiB a
layer; in mini-sequences of 2048 tokens: the 1 GiB input.
"""
from __future__ import annotations

from ..memory.mst.rules import mlp_chunk_tokens
from .dims import Dims


def copies(dims: Dims) -> float:
    """Token copies a rank routes per micro-batch and MoE layer: R k."""
    return dims.tokens_residual * dims.topk


def received(dims: Dims, rows: float = None) -> float:
    """Rows a rank's experts take per MoE layer (of ``rows`` routed rows; default all): the copies at the stated
    load under expert parallelism."""
    rows = dims.tokens_residual if rows is None else rows
    return rows * dims.topk * dims.expert_load


def layer_params(dims: Dims, pre: str) -> list[tuple[str, int, bool]]:
    """An MoE layer's MLP parameters on a rank, ``(name, local numel, decay)`` in ``named_parameters`` order: the
    router ``[E, h]``, this expert rank's experts, the shared expert (tp-sharded like the dense MLP) and its gate."""
    h, f = dims.hidden, dims.expert_ffn
    local = dims.experts // dims.ep
    out = [(pre + "mlp.router.weight", dims.experts * h, True),
           (pre + "mlp.experts.weight1", local * 2 * f * h, True), (pre + "mlp.experts.weight2", local * h * f, True)]
    if dims.shared_ffn:
        fs = dims.shared_ffn // dims.tp
        out += [(pre + "mlp.shared_expert.linear_fc1.weight", 2 * fs * h, True),
                (pre + "mlp.shared_expert.linear_fc2.weight", h * fs, True)]
        if dims.shared_gate:
            out.append((pre + "mlp.shared_expert_gate.weight", h, True))
    return out


def is_expert_param(name: str) -> bool:
    """An expert's weight: sharded over the expert group, FSDP2's over the expert-data ranks."""
    return ".mlp.experts." in name


def flops_fwd(dims: Dims) -> float:
    """Forward FLOPs of one MoE layer's MLP on a rank: the router and k experts of each of its R rows (what the
    rank's experts compute for other ranks balances what its rows cost there), the shared expert on the tokens."""
    h, f = dims.hidden, dims.expert_ffn
    routed = 2.0 * dims.tokens_residual * (h * dims.experts + dims.topk * 3 * h * f)
    shared = 2.0 * dims.tokens * 3 * h * dims.shared_ffn // dims.tp + 2.0 * dims.tokens_residual * h * dims.shared_gate
    return routed + shared


def all_to_all_bytes(dims: Dims) -> float:
    """Bytes the busiest expert rank sends per MoE layer and micro-batch in forward, the (ep - 1) / ep of each
    exchange that leaves it: its copies to the experts (C) and the rows its experts took back to their ranks (C
    times the load); the backward sends the same again (the gradients, the other way)."""
    if dims.ep == 1:
        return 0.0
    return (1 + dims.expert_load) * copies(dims) * (dims.ep - 1) / dims.ep * dims.hidden * dims.compute_bytes


def remade_in_backward(cfg, dims: Dims) -> bool:
    """MsT's chunks re-make the routed part in backward (``memory/mst/moe.py``): its forward exchanges run again."""
    return bool(cfg.memory.mst) and dims.tokens_residual > mlp_chunk_tokens(cfg)


def _per_copy(dims: Dims) -> float:
    """Bytes kept per received row: the grouped matmul's input row, gate and up, silu(gate), their product, and its
    index in the regrouping under expert parallelism."""
    return (dims.hidden + 4 * dims.expert_ffn) * dims.compute_bytes + (8 if dims.ep > 1 else 0)


def routed_kept(dims: Dims, rows: float) -> float:
    """What the routed part keeps for backward on ``rows`` rows: the router's input and fp32 softmax, the top-k
    indices and weights, each copy's gather index, the received rows' set (``_per_copy``), the combine's rows."""
    h, a, k = dims.hidden, dims.compute_bytes, dims.topk
    router = rows * (h * a + dims.experts * 4 + k * (8 + 8 + a))
    return router + rows * k * (16 + h * a) + received(dims, rows) * _per_copy(dims)


def kept_items(dims: Dims, mst_chunk) -> list[tuple[str, float]]:
    """What an MoE layer's MLP keeps for backward, ``(name, bytes)``; with MsT's chunks (``mst_chunk`` tokens) only
    the block's input (``memory/mst/moe.py``: each chunk re-made in backward)."""
    r, h, a = dims.tokens_residual, dims.hidden, dims.compute_bytes
    items = []
    if mst_chunk:
        items.append(("MoE input (MsT's chunks keep only it)", r * h * a))
    else:
        items.append((f"MoE routed rows x {dims.topk} copies (router, experts' [2f], combine)",
                      routed_kept(dims, r)))
    if dims.shared_ffn:
        fs = dims.shared_ffn // dims.tp
        items.append(("shared expert (fc1 input, [gate; up], silu, product)",
                      dims.tokens * h * a + (0 if mst_chunk else dims.tokens * 4 * fs * a)))
    return items


def forward_transient(dims: Dims, mst_chunk) -> float:
    """Peak bytes an MoE call holds briefly in forward above what it keeps: the copies gathered and received for the
    dispatch, the experts' output and its way back; with MsT one chunk's whole set besides."""
    h, a = dims.hidden, dims.compute_bytes
    rows = mst_chunk if mst_chunk else dims.tokens_residual
    c, cr = rows * dims.topk, received(dims, rows)
    moved = (c + cr) * h * a if dims.ep > 1 else c * h * a
    return moved + (routed_kept(dims, rows) if mst_chunk else 0.0)


def backward_transient(dims: Dims, mst_chunk) -> float:
    """Peak bytes of an MoE call's backward above what it keeps: the gradients of the combine's rows on their way
    back, then at the activation the gradients of gate and up, of the product and silu's; with MsT the chunk
    re-made first (its kept set) and the block's input gradient whole."""
    h, f, a = dims.hidden, dims.expert_ffn, dims.compute_bytes
    rows = mst_chunk if mst_chunk else dims.tokens_residual
    c, cr = rows * dims.topk, received(dims, rows)
    peak = max(2 * c * h * a + (cr * h * a if dims.ep > 1 else 0.0), cr * (4 * f + h) * a)
    if mst_chunk:
        peak += routed_kept(dims, rows) + dims.tokens_residual * h * a
    return peak
