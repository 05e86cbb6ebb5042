"""`memory:` section: the memory techniques (recompute, Memo offload, MsT, FPDT chunks, planned arena)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

from .base import check


@dataclass
class MemoryConfig:
    recompute_granularity: Literal["none", "selective", "full"] = "none"
    # memo: Memo's token-wise offload (input + attention output + alpha of the rest per layer on the host);
    # checkpoints: only each layer's input on the host, the whole layer re-run in backward (memory/checkpoint_offload)
    activation_offload: Literal["none", "memo", "checkpoints"] = "none"
    offload_fraction: Union[float, Literal["auto"]] = "auto"  # Memo's alpha
    host_memory_gb: Optional[float] = None  # host budget of one node for offload; default: what the OS reports
    # tokens per mini-sequence of a layer's token-wise parts in token-wise recompute / Memo (memory/memo/steps.py)
    # and in the checkpoints mode's forward and re-run (memory/chunked_layer.py): outside core attention a layer's
    # recompute holds O(chunk) rows; None: all tokens at once
    layer_chunk_size: Optional[int] = None
    # checkpoints mode: only every k-th layer's input goes to the host (layers 0, k, 2k, ...); the backward re-runs
    # the segment of k layers from it (memory/checkpoint_offload.py): ceil(L / k) inputs on the host instead of L,
    # for (L - ceil(L / k)) more layer forwards per step; 1: every layer's input
    checkpoint_every: int = 1
    mst: bool = False
    mst_mlp_chunk_size: Optional[int] = None  # tokens per MLP mini-sequence; default hidden_size
    mst_head_chunks: Optional[int] = None  # chunks of LM head + loss; default ceil(vocab / hidden)
    fpdt_chunk_size: Optional[int] = None  # tokens per FPDT chunk after the all-to-all
    fpdt_offload: bool = True
    plan: Union[str, bool] = "off"  # off | auto | path to a plan.json (YAML reads a bare `off` as false)
    plan_time_limit: float = 10.0

    @property
    def token_wise(self) -> bool:
        """Layers run by token-wise recompute (Memo's runtime): ``recompute_granularity: full`` or Memo offload."""
        return self.activation_offload == "memo" or self.recompute_granularity == "full"

    @property
    def layer_reruns_whole(self) -> bool:
        """Each layer's forward runs without a graph and the whole layer, attention included, re-runs in its
        backward (the host checkpoints): one layer's activations, FPDT's parked chunks among them, exist at a time."""
        return self.activation_offload == "checkpoints"

    def __post_init__(self) -> None:
        if not isinstance(self.offload_fraction, str):
            check(0.0 <= self.offload_fraction <= 1.0,
                  f"memory.offload_fraction ({self.offload_fraction}) must be in [0, 1] or 'auto'")
        if isinstance(self.plan, bool):  # `plan: off` in YAML arrives as False
            check(not self.plan, "memory.plan (true) must be 'off', 'auto' or the path of a plan JSON file")
            self.plan = "off"
        check(self.plan_time_limit > 0, f"memory.plan_time_limit ({self.plan_time_limit}) must be > 0 seconds")
        for name in ("mst_mlp_chunk_size", "mst_head_chunks", "fpdt_chunk_size", "layer_chunk_size",
                     "checkpoint_every"):
            v = getattr(self, name)
            check(v is None or v >= 1, f"memory.{name} ({v}) must be >= 1")
