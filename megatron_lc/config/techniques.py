"""Which technique fills each slot of a layer: the one key by which the model spec (``compose/spec.py``) picks the
classes it builds and the estimator (``estimate/terms/``) picks the terms it adds, each from its own dict.

    techniques = resolve_techniques(cfg, layout)

Example, ``memory.mst: true``, ``recompute_granularity: full``, ``layer_chunk_size: 16384``, ``cp_comm_type: p2p``::

    Techniques(executor="token_wise_recompute", attention_block="self_attention", mlp_and_head="mst",
               layer_rerun="token_wise_mini_sequences", memory_plan="none")

``executor``, ``attention_block`` and ``mlp_and_head`` name the classes the spec builds; ``layer_rerun`` and
``memory_plan`` name no module (the executors' runtimes read ``memory.layer_chunk_size`` -- the host checkpoints' one
is handed the attention part of its chunked layer by ``layer_rerun``, ``compose/context.py`` --, the memory plan's
runtime ``memory.plan``), but they change what a rank holds, so the estimator has a term for each. A technique's own
knobs (Memo's alpha, the host checkpoints' segment length ``checkpoint_every``, FPDT's offload and chunk size, MsT's
chunk sizes) stay in the config; its term reads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .layout import Layout

Executor = Literal["plain", "selective_recompute", "token_wise_recompute", "memo_offload", "host_checkpoints"]
AttentionBlock = Literal["self_attention", "fpdt"]
MlpAndHead = Literal["plain", "mst"]
LayerRerun = Literal["at_once", "token_wise_mini_sequences", "layer_mini_sequences", "block_mini_sequences"]
MemoryPlanKind = Literal["none", "traced_at_setup", "from_file"]

# memory.activation_offload wins over memory.recompute_granularity: Memo's offload runs token-wise recompute itself
# (with full recompute too), the host checkpoints re-run whole layers (the config refuses them with any recompute)
EXECUTOR_BY_OFFLOAD = {"memo": "memo_offload", "checkpoints": "host_checkpoints"}
EXECUTOR_BY_RECOMPUTE = {"none": "plain", "selective": "selective_recompute", "full": "token_wise_recompute"}
# memory.layer_chunk_size cuts the re-run of these executors into mini-sequences (memory/memo/steps.py for the
# token-wise ones, memory/chunked_layer.py for the host checkpoints); the others re-run nothing
MINI_SEQUENCES_BY_EXECUTOR = {"token_wise_recompute": "token_wise_mini_sequences",
                              "memo_offload": "token_wise_mini_sequences",
                              "host_checkpoints": "layer_mini_sequences"}
# the host checkpoints' chunked layer around FPDT's block: the block's own chunks are its attention (config/
# combinations.py refuses layer chunks with FPDT under token-wise recompute)
MINI_SEQUENCES_AROUND_BLOCK = {"layer_mini_sequences": "block_mini_sequences"}
MEMORY_PLAN_BY_SETTING = {"off": "none", "auto": "traced_at_setup"}  # any other value is a plan file's path


@dataclass(frozen=True)
class Techniques:
    """The technique in each slot (see the module doc for an example)."""

    executor: Executor = "plain"  # how each layer runs: plain autograd, or the executor that keeps less
    attention_block: AttentionBlock = "self_attention"  # SelfAttention, or FPDT's chunked block
    mlp_and_head: MlpAndHead = "plain"  # the MLP and the LM head: plain, or MsT's mini-sequence ones
    layer_rerun: LayerRerun = "at_once"  # the executor's re-run: all its rows at once, or in mini-sequences
    # (around a core attention, or around FPDT's block)
    memory_plan: MemoryPlanKind = "none"  # the caching allocator, or a planned arena (traced at setup / a file)


def resolve_techniques(cfg, layout: Layout) -> Techniques:
    """The techniques of ``cfg`` under ``layout`` (refused pairs were refused by ``resolve_layout`` already)."""
    m = cfg.memory
    executor = EXECUTOR_BY_OFFLOAD.get(m.activation_offload) or EXECUTOR_BY_RECOMPUTE[m.recompute_granularity]
    block = "fpdt" if layout.cp_comm_type == "fpdt" else "self_attention"
    rerun = MINI_SEQUENCES_BY_EXECUTOR.get(executor, "at_once") if m.layer_chunk_size is not None else "at_once"
    if block == "fpdt":
        rerun = MINI_SEQUENCES_AROUND_BLOCK.get(rerun, rerun)
    return Techniques(executor=executor, attention_block=block,
                      mlp_and_head="mst" if m.mst else "plain", layer_rerun=rerun,
                      memory_plan=MEMORY_PLAN_BY_SETTING.get(m.plan, "from_file"))


__all__ = ["Techniques", "resolve_techniques"]
