"""Long-context evaluation: loss by position bucket on held-out samples (passkey retrieval: ``passkey.py``), run
under the training layout (tp with or without SP, ring / Ulysses / hybrid / FPDT cp, dp), so a sequence that only
fits spread over cp ranks is evaluated the way it was trained. ``tools/eval_long.py`` is the command line.

**Per-token losses in global order.** The model returns the loss of the tokens a rank holds, in its local order
(``parallel/token_layout.py``); ``gather_sequence`` all-gathers them over cp together with their global positions
and puts every value back in place. Ring cp=2, s=8 (zigzag): rank 0 holds tokens [0 1 | 6 7], rank 1 [2 3 | 4 5];
the all-gather gives the losses of tokens [0 1 6 7 2 3 4 5] on both ranks and ``index_copy`` along that order
restores [0 .. 7]. With tp, every tp rank returns the losses of all its cp rank's tokens (the head all-gathers the
sequence-parallel slices before the vocab-parallel loss), so nothing is gathered over tp. dp ranks evaluate
different samples; their sums are all-reduced over dp at the end.

**Position buckets.** A token's position is the number of earlier tokens it attends to: its index in the sample,
or in its document when the data has document masks (``data.reset_attention_mask``). Default bucket edges are
0, 1K, 4K, 16K, ... (powers of 4 from 1024) cut at the sequence length: 8192 tokens -> [0, 1K) [1K, 4K) [4K, 8K).

Passkey retrieval (the other measure of ``tools/eval_long.py``) is ``passkey.py``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...config import ConfigError, Layout
from ...data import make_batch
from ...parallel.collectives import all_gather, all_reduce
from ...parallel.token_layout import local_token_index, shard_batch
from ...parallel.topology import Axis, Topology

log = logging.getLogger("megatron_lc")

# ---- forward pieces ----------------------------------------------------------------------------------------------
def gather_sequence(local: torch.Tensor, layout: Layout, topo: Topology, seq_length: int,
                    documents=None) -> torch.Tensor:
    """``[b, s_local]`` values of this rank's tokens (local order) -> ``[b, s]`` in global order, on every rank.

    The global positions of each rank's tokens travel with the values (one more all-gather, ``s`` integers), so the
    reordering holds for every layout ``local_token_index`` knows (zigzag, balanced from ``documents``,
    contiguous, hybrid, FPDT strided)."""
    idx = local_token_index(layout, topo, seq_length, documents).to(local.device)
    parts = all_gather(local.contiguous(), topo, Axis.CP, dim=1)  # [b, s], columns in cp-rank order
    order = all_gather(idx, topo, Axis.CP, dim=0)  # [s]: global position of each gathered column
    return torch.empty_like(parts).index_copy_(1, order, parts)


def token_losses_global(model, batch: dict, layout: Layout, topo: Topology) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32, no loss mask applied) of a full-sequence ``batch`` (``make_batch``'s fields
    on the model's device), computed under ``layout`` without autograd, in global position order on every rank."""
    local = shard_batch(batch, layout, topo)
    with torch.no_grad():
        loss = model(local["tokens"], local["position_ids"], local["labels"], local.get("documents"))
    return gather_sequence(loss.float(), layout, topo, batch["tokens"].shape[1], batch.get("documents"))


def vocab_parallel_argmax(logits: torch.Tensor, topo: Topology, vocab_size: int) -> torch.Tensor:
    """Token id of the largest logit, for ``logits [..., V/tp]`` sharded over tp (rank t holds ids
    ``[t*V/tp, (t+1)*V/tp)``); the padding ids past ``vocab_size`` never win, ties go to the smallest id (as
    ``torch.argmax`` of the full logits). Example, tp=2, padded V=8: rank 0's best is id 1 (logit 2.0), rank 1's is
    id 4+2 = 6 (logit 3.0): both ranks return 6."""
    per = logits.shape[-1]
    start = topo.tp_rank * per
    ids = torch.arange(start, start + per, device=logits.device)
    logits = logits.float().masked_fill(ids >= vocab_size, float("-inf"))
    arg = logits.argmax(dim=-1)
    if topo.tp == 1:
        return arg
    best = logits.gather(-1, arg.unsqueeze(-1)).squeeze(-1)
    vals = all_gather(best.unsqueeze(0), topo, Axis.TP, dim=0)  # [tp, ...]
    args = all_gather((arg + start).unsqueeze(0), topo, Axis.TP, dim=0)
    winner = vals.argmax(dim=0, keepdim=True)  # the first tp rank among equal maxima holds the smallest id
    return args.gather(0, winner).squeeze(0)


def predict_tokens(model, batch: dict, positions: torch.Tensor, layout: Layout, topo: Topology,
                   vocab_size: int) -> torch.Tensor:
    """The model's argmax next token at ``positions [b, k]`` (global indices into each row of the full-sequence
    ``batch``; -1 = none) -> ``[b, k]`` token ids (-1 where none), on every rank, without autograd.

    Each cp rank computes the logits of the positions it holds only (``[n, V/tp]`` instead of all its tokens'),
    takes the vocab-parallel argmax over tp and the cp ranks combine by an all-reduce (max over -1 and the id).
    Ring cp=2, s=8, positions [[7, 2]]: rank 0 holds 7 and fills [[id, -1]], rank 1 holds 2 and fills [[-1, id]]."""
    local = shard_batch(batch, layout, topo)
    idx = local_token_index(layout, topo, batch["tokens"].shape[1], batch.get("documents")).to(positions.device)
    where = positions.unsqueeze(-1) == idx.view(1, 1, -1)  # [b, k, s_local]
    rows_b, rows_k = where.any(-1).nonzero(as_tuple=True)
    out = torch.full(positions.shape, -1, dtype=torch.long, device=positions.device)
    with torch.no_grad():
        hidden = model.final_hidden_states(local["tokens"], local["position_ids"], local.get("documents"))
        hidden = model.head.gather_input(hidden)  # [s_local, b, h]: SP's all-gather over tp (identity without)
        if rows_b.numel():  # the same on every tp rank of this cp rank, so they agree on skipping the all-gather
            rows_s = where[rows_b, rows_k].int().argmax(-1)  # local row of each held position
            logits = F.linear(hidden[rows_s, rows_b], model.head.weight)  # [n, V/tp]
            out[rows_b, rows_k] = vocab_parallel_argmax(logits, topo, vocab_size)
    return all_reduce(out, topo, Axis.CP, op=dist.ReduceOp.MAX)


# ---- loss by position bucket -------------------------------------------------------------------------------------
def default_bucket_edges(seq_length: int) -> list[int]:
    """0, 1K, 4K, 16K, ... (powers of 4 from 1024) below ``seq_length``, then ``seq_length``.

    >>> default_bucket_edges(8192), default_bucket_edges(32)
    ([0, 1024, 4096, 8192], [0, 32])
    >>> default_bucket_edges(1048576)
    [0, 1024, 4096, 16384, 65536, 262144, 1048576]
    """
    edges, e = [0], 1024
    while e < seq_length:
        edges.append(e)
        e *= 4
    return edges + [seq_length]


def bucket_edges(seq_length: int, edges: Optional[Sequence[int]] = None) -> list[int]:
    """``edges`` (strictly increasing, from 0) cut at ``seq_length``, or the default ones.

    >>> bucket_edges(100, [0, 10, 50, 200])
    [0, 10, 50, 100]
    """
    if edges is None:
        return default_bucket_edges(seq_length)
    edges = [int(e) for e in edges]
    if not edges or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ConfigError(f"bucket edges {edges} must start at 0 and increase strictly")
    return [e for e in edges if e < seq_length] + [seq_length]


def context_positions(batch: dict) -> torch.Tensor:
    """``[b, s]``: how many earlier tokens each token attends to -- its index in the sample, or in its document
    when the batch has ``document_ids``. Example, document ids ``0 0 0 1 1 2`` -> ``0 1 2 0 1 0``."""
    b, s = batch["tokens"].shape
    pos = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    docs = batch.get("document_ids")
    if docs is None:
        return pos
    start = torch.zeros_like(pos)
    start[:, 1:] = torch.where(docs[:, 1:] != docs[:, :-1], pos[:, 1:], torch.zeros_like(pos[:, 1:]))
    return pos - torch.cummax(start, dim=1).values


@dataclass
class PositionLoss:
    """Loss sums and token counts (fp64) per bucket ``[edges[i], edges[i+1])`` of context position."""

    edges: list[int]
    loss_sum: torch.Tensor = field(init=False)
    tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros(len(self.edges) - 1, dtype=torch.float64)
        self.tokens = torch.zeros(len(self.edges) - 1, dtype=torch.float64)

    def add(self, token_loss: torch.Tensor, loss_mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Count ``token_loss [b, s]`` of the tokens ``loss_mask`` keeps, by ``positions [b, s]``."""
        inner = torch.tensor(self.edges[1:-1], dtype=positions.dtype)
        # bucket i holds edges[i] <= p < edges[i+1]
        bucket = torch.bucketize(positions.cpu().contiguous(), inner, right=True).flatten()
        mask = loss_mask.detach().cpu().double().flatten()
        self.loss_sum.index_add_(0, bucket, token_loss.detach().cpu().double().flatten() * mask)
        self.tokens.index_add_(0, bucket, mask)

    def reduce(self, topo: Topology, device: torch.device) -> None:
        """Sum over dp ranks (each evaluated its own samples); ``device``: where the backend reduces (nccl: cuda)."""
        both = all_reduce(torch.stack([self.loss_sum, self.tokens]).to(device), topo, Axis.DP).cpu()
        self.loss_sum, self.tokens = both[0].clone(), both[1].clone()

    def summary(self) -> dict:
        """``{"mean_loss", "tokens", "buckets": [{"start", "end", "mean_loss", "tokens"}, ...]}`` (mean None for an
        empty bucket)."""
        def mean(s, n):
            return float(s / n) if n > 0 else None

        buckets = [{"start": a, "end": b, "mean_loss": mean(s, n), "tokens": int(n)}
                   for a, b, s, n in zip(self.edges, self.edges[1:], self.loss_sum.tolist(), self.tokens.tolist())]
        return {"mean_loss": mean(float(self.loss_sum.sum()), float(self.tokens.sum())),
                "tokens": int(self.tokens.sum()), "buckets": buckets}


def evaluate_positions(model, dataset, sample_ids: list[int], data_cfg, layout: Layout, topo: Topology,
                       device: torch.device, edges: list[int]) -> PositionLoss:
    """Loss by position bucket over ``sample_ids``: dp rank r takes every dp-th sample from the r-th, in micro-batches
    of the layout's size; the sums are then added over dp (every rank returns the totals)."""
    acc = PositionLoss(edges)
    mine = sample_ids[topo.dp_rank::layout.dp]
    mbs = layout.micro_batch_size
    for i in range(0, len(mine), mbs):
        t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in make_batch(dataset, mine[i:i + mbs], data_cfg).items()}
        loss = token_losses_global(model, batch, layout, topo)
        acc.add(loss, batch["loss_mask"], context_positions(batch))
        log.info("position loss: samples %d-%d of %d on this dp rank (%.1f s)", i + 1, min(i + mbs, len(mine)),
                 len(mine), time.perf_counter() - t0)
    acc.reduce(topo, device)
    return acc
