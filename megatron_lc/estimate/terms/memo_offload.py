"""Memo's token-wise offload (``activation_offload: memo``; ``memory/memo/``): each layer keeps its input, its
attention output and lse and the first alpha of the token-wise rest's tokens; those kept bytes go through two
rounding buffers on the device and are copied to the host after the layer (not for the last two layers) and back
before its backward; the other (1 - alpha) of the tokens run without a graph and again in the backward.

alpha with ``offload_fraction: auto`` is the LP of Memo section 4.1 (``memory/memo/alpha.py``, one home): the
largest alpha whose copy hides under a layer's forward and whose n - 2 swapped layers fit the host budget that
the terms before left (FPDT's parked chunks, FSDP2's offloaded states). Example, Llama3-8B at 1M tokens on 8 H100s
(tp 1, ring cp 8, MsT): alpha = 0.25 gives rounding buffers of 8.78 GiB and 1054 GiB of host memory per node.
"""
from __future__ import annotations

from dataclasses import replace

from ...memory.memo.alpha import AlphaInputs
from ...memory.memo.alpha import bounds as alpha_bounds
from .. import transient as T
from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, TimeShare

ALIGNED_GROUPS = 32  # a rounding buffer's aligned groups of 256 bytes (memory/memo/slots.py)


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


def offloaded_bytes(run: Run, share: TimeShare) -> float:
    """What one layer copies each way: its input, attention output, lse and alpha of the rest."""
    g = LayerShape(share.shape.mlp_chunked, False, True).groups(run.dims)
    return g["input"] + g["attn"] + (share.alpha or 0.0) * g["others"]


class MemoOffload(Term):
    """``activation_offload: memo`` (see the module doc)."""

    def shape(self, run: Run, shape: LayerShape) -> LayerShape:
        return replace(shape, local_qkv=True)  # Memo's slot holds the local q, k, v like token-wise recompute

    def memory(self, run: Run, share: MemoryShare) -> MemoryShare:
        """Nothing per layer on the device: the two rounding buffers hold the kept bytes of the layers in flight
        (+ their aligned groups); kept tensors are copied into a buffer as autograd saves them
        (``memory/memo/slots.py``), so nothing is staged. The dropped tokens' tensors are rematerialised into
        autograd's allocations during one layer's backward: the layer backward's moments when the attention block
        runs its backward from (out, lse) (``transient.tokenwise_backward``), else ``recompute``. Setup profiles
        layer 0 with every token kept."""
        cfg, dims, hw = run.cfg, run.dims, run.hw
        g = share.groups
        notes = share.notes
        ranks_per_node = min(hw.gpus_per_node, dims.world)
        host_share = share.host_left(hw.host_bytes_per_node / ranks_per_node)
        if cfg.memory.offload_fraction == "auto":
            alpha, why = solve_alpha(g["input"], g["attn"], g["others"], run.host_bytes_per_s, run.t_layer_fwd,
                                     dims.num_layers, host_share)
            notes += (f"alpha = {alpha:.3f} (LP of Memo §4.1; binding: {why})",)
        else:
            alpha = float(cfg.memory.offload_fraction)
        kept = g["input"] + g["attn"] + alpha * g["others"]
        no_graph = 1.0 - alpha
        return replace(share, kept=0.0, alpha=alpha, rounding=2 * (kept + ALIGNED_GROUPS * 256),
                       host=share.host + (("Memo copies", max(dims.num_layers - 2, 0) * kept),),
                       recompute=0.0 if share.attention_from_lse else (1.0 - alpha) * g["others"],
                       no_graph=no_graph, rerun=no_graph, pre_no_graph_tokens=no_graph * dims.tokens,
                       setup_probes=share.setup_probes + (share.full + T.layer_forward(cfg, dims),), notes=notes)

    def time(self, run: Run, seconds: LayerSeconds, share: TimeShare) -> TimeShare:
        """(1 - alpha) of the token-wise part runs again; the copies hide under the next layer's forward and
        backward, what exceeds them stalls."""
        a = share.alpha if share.alpha is not None else 0.0
        return replace(share, recompute=share.recompute + (1.0 - a) * (seconds.linear_fwd + seconds.tp_fwd),
                       offloaded=share.offloaded + offloaded_bytes(run, share))
