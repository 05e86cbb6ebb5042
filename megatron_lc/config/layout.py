"""The resolved layout: every divisibility rule and derived size of a run, computed once from the config and the
world size, frozen, and passed to whatever needs a layout fact (topology, data sharding, core attention, FPDT,
the memory techniques, the loop, the estimator). The config itself is never changed.

    layout = resolve_layout(cfg, world_size=8)    # one-line ConfigError naming the numbers when impossible

Example, 8 ranks, ``tp=2, cp=4, cp_comm_type=a2a+p2p, ulysses_size=2, sequence_parallel``, 32 heads / 8 kv heads,
``seq_length=1024``, ``micro_batch_size=1``, ``global_batch_size=4``::

    dp = 8 / (2 x 4) = 1       ring = 4 / 2 = 2                 heads, kv_heads per tp rank = 16, 4
    local_seq_length = 1024 / 4 = 256 tokens per cp rank        block_seq_length = 256 / 2 = 128 rows (SP)
    seq_multiple = 2 x 4 (zigzag over the ring, Ulysses pieces) x 2 (SP) = 16
    kv_replication = lcm(4, 2) / 4 = 1                          num_micro_batches = 4 / (1 x 1) = 4
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .base import ConfigError, check
from .combinations import check_combinations


def kv_replication(heads: int, kv_heads: int, ulysses: int) -> int:
    """How many times each kv head is copied so that each of ``ulysses`` ranks receives whole GQA groups after the
    head scatter of an all-to-all (Ulysses, hybrid and FPDT all use this count).

    Query head ``i`` uses kv head ``i // (heads / kv_heads)``; Ulysses rank ``u`` gets query heads
    ``[u*heads/U, (u+1)*heads/U)``. Copying each kv head ``lcm(kv_heads, U) / kv_heads`` times in place
    (``repeat_interleave``) makes every rank's query heads map onto a whole, contiguous block of kv copies.

    >>> kv_replication(8, 2, 4)    # 2 kv heads, 4 ranks: each kv head twice -> 4 copies, one per rank
    2
    >>> kv_replication(8, 8, 4), kv_replication(8, 1, 4)    # enough kv heads; MQA
    (1, 4)
    """
    if heads % ulysses != 0:
        raise ConfigError(f"attention heads per tp rank ({heads}) must be divisible by ulysses size ({ulysses}): the "
                          f"all-to-all hands every rank whole heads, so their count must be divisible by the "
                          f"Ulysses size")
    if heads % kv_heads != 0:
        raise ConfigError(f"attention heads ({heads}) must be divisible by kv heads ({kv_heads})")
    return math.lcm(kv_heads, ulysses) // kv_heads


@dataclass(frozen=True)
class Layout:
    """Degrees, sizes and chunk counts of one run (see the module doc for an example)."""

    world_size: int
    dp: int
    tp: int
    cp: int
    ring: int
    ulysses: int
    cp_comm_type: str
    # the ring ranks' tokens (parallel/token_layout.ring_spans): "zigzag" or "balanced" (parallel.cp_layout resolved;
    # "zigzag" wherever there is no ring)
    cp_layout: str
    sequence_parallel: bool  # Megatron SP in effect: parallel.sequence_parallel and tp > 1
    seq_length: int
    seq_multiple: int  # the sequence length must be a multiple of this for the layout
    fpdt_chunks: int  # u: chunks per rank of FPDT (1 for the other layouts)
    heads: int  # query heads per tp rank
    kv_heads: int  # kv heads per tp rank
    kv_replication: int  # copies of each kv head for the head scatter over the Ulysses ranks
    micro_batch_size: int
    global_batch_size: int
    # each layer's causal sliding window in tokens (None: full attention; model.sliding_window, model.layer_types):
    # the core attention built for layer n takes windows[n]
    windows: tuple = ()
    # each layer's RoPE as (theta, rope_scaling applies) (None without RoPE; model.rope_local_base_freq on the
    # sliding_attention layers): the model computes each distinct table once a step and hands layer n ropes[n]'s
    ropes: tuple = ()
    # expert parallelism: each MoE layer's experts sharded over groups of ep dp x cp ranks (1: every rank holds all)
    ep: int = 1

    @property
    def balance_window(self):
        """The window the balanced layout weighs the tokens' work by: the layers' common one, None when any layer
        attends every earlier key (those layers' work dominates) -- one layout serves every layer."""
        return None if not self.windows or None in self.windows or len(set(self.windows)) > 1 else self.windows[0]

    def window(self, layer_number: int):
        """Layer ``layer_number``'s window (None: every earlier key)."""
        return self.windows[layer_number] if self.windows else None

    def rope(self, layer_number: int):
        """Layer ``layer_number``'s RoPE: (theta, rope_scaling applies), or None without RoPE."""
        return self.ropes[layer_number] if self.ropes else None

    @property
    def sp_degree(self) -> int:
        """tp when sequence parallelism splits each cp rank's tokens again over tp, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def local_seq_length(self) -> int:
        """Tokens of one sample that a cp rank holds (what its core attention sees)."""
        return self.seq_length // self.cp

    @property
    def block_seq_length(self) -> int:
        """Rows of the hidden states between blocks on one rank (``local_seq_length / tp`` with SP)."""
        return self.local_seq_length // self.sp_degree

    @property
    def fpdt_chunk_tokens(self) -> int:
        """Tokens of one gathered FPDT chunk (``memory.fpdt_chunk_size``; the whole sequence when u = 1)."""
        return self.seq_length // self.fpdt_chunks

    @property
    def num_micro_batches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)


def _seq_multiple(cp: int, ring: int, kind: str, sp_degree: int) -> int:
    """p2p / a2a+p2p: 2 zigzag chunks per ring rank, each cut into Ulysses pieces (2*cp; cp when the ring is 1);
    a2a and fpdt: cp; times tp with sequence parallelism (each cp shard is split again over tp)."""
    m = 1
    if cp > 1:
        m = 2 * cp if (kind in ("p2p", "a2a+p2p") and ring > 1) else cp
    return m * sp_degree


def _fpdt_chunks(cfg, cp: int, sp_degree: int) -> int:
    """u = seq_length / memory.fpdt_chunk_size; the chunk must divide the sequence and split over cp x SP tp."""
    s = cfg.data.seq_length
    chunk = cfg.memory.fpdt_chunk_size or s
    if chunk > s or s % chunk != 0:
        raise ConfigError(f"memory.fpdt_chunk_size ({chunk}) must divide data.seq_length ({s}) "
                          f"(FPDT cuts the sequence into equal chunks; no padding)")
    if chunk % (cp * sp_degree) != 0:
        raise ConfigError(f"memory.fpdt_chunk_size ({chunk}) must be divisible by cp ({cp})"
                          + (f" x tp ({sp_degree}) with sequence_parallel" if sp_degree > 1 else "")
                          + f" = {cp * sp_degree}: each rank contributes chunk/{cp * sp_degree} tokens to every chunk")
    return s // chunk


def resolve_layout(cfg, world_size: int) -> Layout:
    """Validate the parallel layout and the feature combination of ``cfg`` for ``world_size`` ranks; the frozen
    ``Layout``. Every refusal is a one-line ``ConfigError`` naming the numbers (or both keys of a feature pair)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    check_combinations(cfg)
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    check(world_size % (tp * cp) == 0,
          f"world size ({world_size}) must be divisible by tp ({tp}) x cp ({cp}) = {tp * cp}")
    dp = world_size // (tp * cp)
    check(m.num_attention_heads % tp == 0,
          f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by tp ({tp})")
    check(m.num_query_groups % tp == 0,
          f"model.num_query_groups ({m.num_query_groups}) must be divisible by tp ({tp})")
    check(m.ffn_hidden_size % tp == 0, f"model.ffn_hidden_size ({m.ffn_hidden_size}) must be divisible by tp ({tp})")
    check(m.padded_vocab_size % tp == 0,
          f"padded vocab ({m.padded_vocab_size}) must be divisible by tp ({tp}); "
          f"set model.make_vocab_size_divisible_by to a multiple of {tp}")
    heads, kv_heads = m.num_attention_heads // tp, m.num_query_groups // tp
    check(heads % p.ulysses_size == 0,
          f"attention heads per tp rank ({heads}) must be divisible by ulysses size ({p.ulysses_size})")
    rep = kv_replication(heads, kv_heads, p.ulysses_size)
    sp = p.sequence_parallel and tp > 1
    sp_degree = tp if sp else 1
    s = cfg.data.seq_length
    mult = _seq_multiple(cp, p.ring_size, p.cp_comm_type, sp_degree)
    check(s % mult == 0,
          f"data.seq_length ({s}) must be divisible by {mult} for cp ({cp}, {p.cp_comm_type}) x tp ({tp}, "
          f"sequence_parallel={p.sequence_parallel})")
    u = _fpdt_chunks(cfg, cp, sp_degree) if p.cp_comm_type == "fpdt" else 1
    check(s <= m.max_position_embeddings or m.position_embedding_type == "rope",
          f"data.seq_length ({s}) exceeds model.max_position_embeddings ({m.max_position_embeddings})")
    ep = p.expert_model_parallel_size
    check(ep == 1 or (m.num_moe_experts is not None and m.num_moe_experts % ep == 0),
          f"parallel.expert_model_parallel_size ({ep}) must divide model.num_moe_experts ({m.num_moe_experts})")
    check((dp * cp) % ep == 0,
          f"parallel.expert_model_parallel_size ({ep}) must divide dp x cp ({dp} x {cp} = {dp * cp}): the experts "
          f"are sharded over the ranks that hold the same weights")
    mbs = t.micro_batch_size
    gbs = t.global_batch_size if t.global_batch_size is not None else mbs * dp
    check(gbs % (mbs * dp) == 0,
          f"train.global_batch_size ({gbs}) must be divisible by micro_batch_size ({mbs}) x dp ({dp})")
    return Layout(world_size=world_size, dp=dp, tp=tp, cp=cp, ring=p.ring_size, ulysses=p.ulysses_size,
                  cp_comm_type=p.cp_comm_type, sequence_parallel=sp,
                  cp_layout="balanced" if p.cp_layout != "zigzag" and p.ring_size > 1 else "zigzag",
                  seq_length=s, seq_multiple=mult, fpdt_chunks=u,
                  heads=heads, kv_heads=kv_heads, kv_replication=rep, micro_batch_size=mbs, global_batch_size=gbs,
                  windows=m.attention_windows(), ropes=m.layer_ropes(), ep=ep)


__all__ = ["Layout", "resolve_layout", "kv_replication"]
