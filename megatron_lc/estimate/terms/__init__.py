"""The estimator's terms: one per technique, looked up by the slot's technique (``config.Techniques``, the key the
model spec looks its classes up by) in this module's dicts. ``term.py`` is the interface; each technique's file
says what it keeps, stages, reserves, rematerialises and costs.

    terms = terms_for(resolve_techniques(cfg, layout))          # Terms(mlp_and_head=..., executor=..., ...)
    terms_for(techniques, recompute_style="checkpoint")          # the papers' classic checkpointing, a what-if

Adding a technique: its term file here and one entry in its slot's dict (and its key in ``config/techniques.py``).
"""
from __future__ import annotations

from ...config import ConfigError, Techniques
from .classic_checkpoint import ClassicCheckpoint, ClassicCheckpointOffload
from .fpdt import FPDTBlock
from .host_checkpoints import HostCheckpoints
from .memo_offload import MemoOffload, solve_alpha
from .memory_plan import CachingAllocator, PlanFromFile, PlanTracedAtSetup
from .mini_sequences import AtOnce, BlockMiniSequences, LayerMiniSequences, TokenWiseMiniSequences
from .mst import MiniSequenceMlpAndHead
from .plain import PlainLayer, PlainMlpAndHead, SelfAttentionBlock
from .selective import SelectiveRecompute
from .term import LayerSeconds, LayerShape, MemoryShare, Run, Term, Terms, TimeShare
from .token_wise import TokenWiseRecompute

MLPS_AND_HEADS = {"plain": PlainMlpAndHead(), "mst": MiniSequenceMlpAndHead()}
ATTENTION_BLOCKS = {"self_attention": SelfAttentionBlock(), "fpdt": FPDTBlock()}
EXECUTORS = {"plain": PlainLayer(), "selective_recompute": SelectiveRecompute(),
             "token_wise_recompute": TokenWiseRecompute(), "memo_offload": MemoOffload(),
             "host_checkpoints": HostCheckpoints()}
LAYER_RERUNS = {"at_once": AtOnce(), "token_wise_mini_sequences": TokenWiseMiniSequences(),
                "layer_mini_sequences": LayerMiniSequences(), "block_mini_sequences": BlockMiniSequences()}
MEMORY_PLANS = {"none": CachingAllocator(), "traced_at_setup": PlanTracedAtSetup(), "from_file": PlanFromFile()}

# recompute_style: token_wise is this framework; checkpoint a what-if for the papers' baselines, classic activation
# checkpointing in place of the token-wise executors (``classic_checkpoint.py``), every re-run at once
RECOMPUTE_STYLES = {
    "token_wise": (EXECUTORS, LAYER_RERUNS),
    "checkpoint": ({**EXECUTORS, "token_wise_recompute": ClassicCheckpoint(),
                    "memo_offload": ClassicCheckpointOffload()}, {key: AtOnce() for key in LAYER_RERUNS}),
}


def terms_for(techniques: Techniques, recompute_style: str = "token_wise") -> Terms:
    """The term of each slot of ``techniques``; ``recompute_style`` (``token_wise`` | ``checkpoint``) picks the
    executors' and re-runs' dicts."""
    if recompute_style not in RECOMPUTE_STYLES:
        raise ConfigError(f"recompute_style must be token_wise or checkpoint, got {recompute_style!r}")
    executors, reruns = RECOMPUTE_STYLES[recompute_style]
    return Terms(mlp_and_head=MLPS_AND_HEADS[techniques.mlp_and_head],
                 attention_block=ATTENTION_BLOCKS[techniques.attention_block],
                 executor=executors[techniques.executor], layer_rerun=reruns[techniques.layer_rerun],
                 memory_plan=MEMORY_PLANS[techniques.memory_plan])


__all__ = ["LayerSeconds", "LayerShape", "MemoryShare", "Run", "Term", "Terms", "TimeShare", "solve_alpha",
           "terms_for"]
