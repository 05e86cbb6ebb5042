"""Feature pairs the framework refuses, each with its reason, checked before anything is built.

Every other pair of features runs and gives the plain model's losses (``tests/config/test_feature_pairs.py`` trains each
pair two steps against the single-process model). A refusal is one line naming both keys and why."""
from __future__ import annotations

from .base import ConfigError

CUDA_ONLY = ("cudnn", "fa3", "fa4", "flash", "te")  # attention backends with no CPU kernel (attention/backends.py)


def _refusals(cfg):
    """(condition, message) for every refused pair."""
    m, p = cfg.memory, cfg.parallel
    yield (m.recompute_granularity == "selective" and m.activation_offload == "memo",
           f"memory.recompute_granularity=selective with memory.activation_offload={m.activation_offload}: "
           f"selective recomputes core attention, offload keeps its output; use recompute_granularity full or none "
           f"with memo")
    yield (m.recompute_granularity == "selective" and p.cp_comm_type == "fpdt",
           "memory.recompute_granularity=selective with parallel.cp_comm_type=fpdt: selective checkpoints the core "
           "attention, and FPDT's block has none (it keeps only its chunks, on the host with fpdt_offload); use "
           "recompute_granularity full (token-wise recompute around the FPDT block) or none")
    yield (m.activation_offload == "checkpoints" and m.recompute_granularity != "none",
           f"memory.activation_offload=checkpoints with memory.recompute_granularity={m.recompute_granularity}: the "
           f"checkpoints mode re-runs every whole layer already; set recompute_granularity none")
    rerun = m.recompute_granularity == "full" or m.activation_offload in ("memo", "checkpoints")
    yield (m.layer_chunk_size is not None and not rerun,
           f"memory.layer_chunk_size with memory.recompute_granularity={m.recompute_granularity} and "
           f"memory.activation_offload={m.activation_offload}: the mini-sequences are those of a re-run (token-wise "
           f"recompute or the checkpoints mode); set recompute_granularity full or activation_offload memo or "
           f"checkpoints")
    yield (m.layer_chunk_size is not None and p.cp_comm_type == "fpdt" and m.activation_offload != "checkpoints",
           f"memory.layer_chunk_size with parallel.cp_comm_type=fpdt and memory.activation_offload="
           f"{m.activation_offload}: FPDT's block is the attention of the checkpoints mode's chunked layer only "
           f"(token-wise recompute runs around the whole block); set activation_offload checkpoints or unset "
           f"layer_chunk_size")
    yield (m.checkpoint_every > 1 and m.activation_offload != "checkpoints",
           f"memory.checkpoint_every={m.checkpoint_every} with memory.activation_offload={m.activation_offload}: "
           f"the segments are those of the host checkpoints (every k-th layer's input on the host); set "
           f"activation_offload checkpoints or checkpoint_every 1")
    yield (p.use_torch_fsdp2 and p.use_distributed_optimizer,
           "parallel.use_torch_fsdp2 with parallel.use_distributed_optimizer: FSDP2 already shards the optimizer "
           "states (with the weights and gradients); set use_distributed_optimizer false")
    yield (p.attention_backend in CUDA_ONLY and cfg.train.device == "cpu",
           f"parallel.attention_backend={p.attention_backend} with train.device=cpu: its kernels run on CUDA only; "
           f"use attention_backend auto, torch or math")
    yield (p.fsdp_cpu_offload and not p.use_torch_fsdp2,
           "parallel.fsdp_cpu_offload without parallel.use_torch_fsdp2: the offload is FSDP2's (CPUOffloadPolicy); "
           "set use_torch_fsdp2 true")


def _moe_refusals(cfg):
    """Mixture-of-experts pairs (``model/moe.py``, ``parallel/expert_parallel.py``)."""
    m, p = cfg.model, cfg.parallel
    moe = m.num_moe_experts is not None
    ep = p.expert_model_parallel_size
    yield (ep > 1 and not moe,
           f"parallel.expert_model_parallel_size={ep} without model.num_moe_experts: there are no experts to shard")
    yield (moe and p.tensor_model_parallel_size > 1 and not p.sequence_parallel,
           f"model.num_moe_experts with parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} and "
           f"sequence_parallel false: the experts are whole on every tp rank and take its sequence-parallel share "
           f"of the tokens (as Megatron-LM asks); set sequence_parallel true")
    yield (ep > 1 and p.use_distributed_optimizer,
           f"parallel.expert_model_parallel_size={ep} with parallel.use_distributed_optimizer: ZeRO-1 shards every "
           f"state over dp x cp, where the expert ranks hold different experts; use use_torch_fsdp2 (the experts "
           f"sharded over the ranks outside their expert group) or plain AdamW")
    yield (ep > 1 and cfg.memory.activation_offload == "memo",
           f"parallel.expert_model_parallel_size={ep} with memory.activation_offload=memo: the rows an expert rank "
           f"receives change every step and Memo's rounding buffers are sized once; use recompute_granularity full "
           f"(token-wise recompute without offload) or activation_offload checkpoints")
    yield (moe and cfg.memory.activation_offload == "memo" and len(set(m.moe_layers())) > 1,
           f"model.moe_layer_freq={m.moe_layer_freq} with memory.activation_offload=memo: Memo sizes its rounding "
           f"buffers by layer 0, and dense and MoE layers keep different tensors; make every layer MoE or use "
           f"activation_offload checkpoints")


def _document_refusals(cfg):
    """Documents and windows reach the kernels as rectangles (attention/ranges.py): PyTorch's kernels take them (one
    call each on CPU, the variable-length kernel on CUDA); the flash-attn / TransformerEngine adapters do not."""
    p = cfg.parallel
    yield (cfg.data.reset_attention_mask and p.attention_backend in ("flash", "te"),
           f"data.reset_attention_mask with parallel.attention_backend={p.attention_backend}: documents reach the "
           f"kernel as rectangles, which the flash-attn / TransformerEngine adapters do not take (their varlen entry "
           f"points are not wired); use attention_backend auto or torch")
    yield (cfg.model.sliding_window is not None and p.attention_backend in ("flash", "te"),
           f"model.sliding_window with parallel.attention_backend={p.attention_backend}: a window reaches the kernel "
           f"as rectangles, which the flash-attn / TransformerEngine adapters do not take (their window arguments "
           f"are not wired); use attention_backend auto or torch")


def check_combinations(cfg) -> None:
    """Raise ``ConfigError`` for the first refused feature pair of ``cfg``."""
    for refused, message in [*_refusals(cfg), *_moe_refusals(cfg), *_document_refusals(cfg)]:
        if refused:
            raise ConfigError(message)
