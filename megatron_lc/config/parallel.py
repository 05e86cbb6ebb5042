"""`parallel:` section: degrees of the rank grid and the context-parallel flavour."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check

CP_COMM_TYPES = ("p2p", "a2a", "a2a+p2p", "fpdt")


@dataclass
class ParallelConfig:
    """tp x cp x dp = world size; dp is derived. ``cp_comm_type`` uses Megatron's names:
    p2p = ring, a2a = Ulysses, a2a+p2p = Ulysses inside x ring across, fpdt = chunked Ulysses (FPDT)."""

    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    cp_comm_type: Literal["p2p", "a2a", "a2a+p2p", "fpdt"] = "p2p"
    ulysses_size: Optional[int] = None  # a2a sub-axis of cp for a2a+p2p; default: cp for a2a/fpdt, 1 for p2p
    # which tokens each ring rank holds (parallel/token_layout.py): zigzag (2R equal chunks, balanced for one causal
    # sequence; k/v travel the whole ring) or balanced (from each micro-batch's packed documents and the window:
    # equal attention work per rank, only the k/v a rank's queries see are sent: parallel/cp_balance.py,
    # attention/kv_plan.py); auto = balanced wherever there is a ring (ring size > 1), which without documents or a
    # window is the zigzag itself
    cp_layout: Literal["auto", "zigzag", "balanced"] = "auto"
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False  # ZeRO-1: optimizer states sharded over the dp x cp group
    # FSDP2 (parallel/fsdp.py): weights, gradients and optimizer states sharded over dp x cp (Megatron-LM's
    # --use-torch-fsdp2); fsdp_cpu_offload keeps the shards, gradients and AdamW states on the host
    use_torch_fsdp2: bool = False
    fsdp_cpu_offload: bool = False
    # attention/backends.py: auto (the fastest measured on this GPU, configs/hardware), torch (PyTorch's fused
    # kernels), cudnn (cuDNN's, in stock PyTorch), fa3 / fa4 (FlashAttention-3 / 4 through torch's registry),
    # flash (flash-attn 2), te (TransformerEngine), math (the reference)
    attention_backend: Literal["auto", "torch", "cudnn", "fa3", "fa4", "math", "flash", "te"] = "auto"
    # auto: gloo on CPU; on CUDA "cpu:gloo,cuda:nccl" -- NCCL for device tensors, gloo for the few CPU scalars
    # (step flags, token counts); plain "nccl" refuses every CPU tensor
    distributed_backend: Literal["auto", "gloo", "nccl", "cpu:gloo,cuda:nccl"] = "auto"
    distributed_timeout_minutes: float = 10.0
    # expert parallelism (parallel/expert_parallel.py): an MoE layer's experts sharded over groups of this many
    # dp x cp ranks, tokens exchanged by all-to-all (Megatron-LM's name); must divide dp x cp and the experts
    expert_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        check(self.tensor_model_parallel_size >= 1,
              f"parallel.tensor_model_parallel_size ({self.tensor_model_parallel_size}) must be >= 1")
        check(self.context_parallel_size >= 1,
              f"parallel.context_parallel_size ({self.context_parallel_size}) must be >= 1")
        check(self.expert_model_parallel_size >= 1,
              f"parallel.expert_model_parallel_size ({self.expert_model_parallel_size}) must be >= 1")
        cp = self.context_parallel_size
        if self.ulysses_size is None:
            self.ulysses_size = {"p2p": 1, "a2a": cp, "fpdt": cp}.get(self.cp_comm_type, None)
            if self.ulysses_size is None:  # a2a+p2p without a size: the largest power-of-2 factor <= sqrt(cp)
                u = 1
                while u * u * 4 <= cp and cp % (2 * u) == 0:
                    u *= 2
                self.ulysses_size = u if cp > 1 else 1
        check(self.ulysses_size >= 1 and cp % self.ulysses_size == 0,
              f"parallel.ulysses_size ({self.ulysses_size}) must divide parallel.context_parallel_size ({cp})")
        if self.cp_comm_type in ("a2a", "fpdt"):
            check(self.ulysses_size == cp,
                  f"parallel.ulysses_size ({self.ulysses_size}) must equal parallel.context_parallel_size ({cp}) "
                  f"for cp_comm_type {self.cp_comm_type}")
        check(self.cp_layout != "balanced" or self.ring_size > 1,
              f"parallel.cp_layout=balanced with parallel.cp_comm_type={self.cp_comm_type} and a ring of "
              f"{self.ring_size} (context_parallel_size {cp} / ulysses_size {self.ulysses_size}): the balanced layout "
              f"places tokens on ring ranks; Ulysses and FPDT split heads, balanced whatever the documents; use "
              f"cp_layout auto")
        if self.cp_comm_type == "p2p":
            check(self.ulysses_size == 1,
                  f"parallel.ulysses_size ({self.ulysses_size}) must be 1 for cp_comm_type p2p (use a2a+p2p)")

    @property
    def ring_size(self) -> int:
        return self.context_parallel_size // self.ulysses_size
