"""Long-context evaluation: loss by position bucket on held-out samples and passkey retrieval, run under the
training layout (tp with or without SP, ring / Ulysses / hybrid / FPDT cp, dp), so a sequence that only fits spread
over cp ranks is evaluated the way it was trained. ``tools/eval_long.py`` is the command line.

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

**Passkey.** A prompt of ``length`` tokens: filler, a needle holding a random key of digits at ``depth`` (fraction
of the filler before it), the question, and the key as the answer::

    [intro] filler[:n1] [needle_before KEY needle_after] filler[n1:n] [question] KEY | filler ...
                                                                       ^ answer: the last tokens of the prompt

Scored teacher-forced: the model reads the prompt and, at each answer token, its argmax over the vocabulary
(``predict_tokens``, from the logits of those positions only) must be that key token. A prompt shorter than
``data.seq_length`` is continued with filler to that length, so every forward has the shape the layout was resolved
for (divisibility, FPDT chunks); tokens after the answer cannot change its logits (causal attention). Without a
tokenizer the pieces are token ids (digit d is token d, NullTokenizer style); with ``data.tokenizer_model`` (or the
demo's) they are English sentences, each piece encoded on its own, so the key has the same tokens in the needle and
in the answer.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError, Layout
from ..data import make_batch
from ..data.tokenizer import SentencePieceTokenizer
from ..parallel.collectives import all_gather, all_reduce
from ..parallel.token_layout import local_token_index, shard_batch
from ..parallel.topology import Axis, Topology

log = logging.getLogger("megatron_lc")

MOCK_HELD_OUT_START = 2**31  # mock data (random tokens, no epoch): held-out samples start past any run's position


# ---- forward pieces ----------------------------------------------------------------------------------------------
def gather_sequence(local: torch.Tensor, layout: Layout, topo: Topology, seq_length: int) -> torch.Tensor:
    """``[b, s_local]`` values of this rank's tokens (local order) -> ``[b, s]`` in global order, on every rank.

    The global positions of each rank's tokens travel with the values (one more all-gather, ``s`` integers), so the
    reordering holds for every layout ``local_token_index`` knows (zigzag, contiguous, hybrid, FPDT strided)."""
    idx = local_token_index(layout, topo, seq_length).to(local.device)
    parts = all_gather(local.contiguous(), topo, Axis.CP, dim=1)  # [b, s], columns in cp-rank order
    order = all_gather(idx, topo, Axis.CP, dim=0)  # [s]: global position of each gathered column
    return torch.empty_like(parts).index_copy_(1, order, parts)


def token_losses_global(model, batch: dict, layout: Layout, topo: Topology) -> torch.Tensor:
    """Per-token loss ``[b, s]`` (fp32, no loss mask applied) of a full-sequence ``batch`` (``make_batch``'s fields
    on the model's device), computed under ``layout`` without autograd, in global position order on every rank."""
    local = shard_batch(batch, layout, topo)
    with torch.no_grad():
        loss = model(local["tokens"], local["position_ids"], local["labels"], local.get("document_ids"))
    return gather_sequence(loss.float(), layout, topo, batch["tokens"].shape[1])


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
    idx = local_token_index(layout, topo, batch["tokens"].shape[1]).to(positions.device)
    where = positions.unsqueeze(-1) == idx.view(1, 1, -1)  # [b, k, s_local]
    rows_b, rows_k = where.any(-1).nonzero(as_tuple=True)
    out = torch.full(positions.shape, -1, dtype=torch.long, device=positions.device)
    with torch.no_grad():
        hidden = model.final_hidden_states(local["tokens"], local["position_ids"], local.get("document_ids"))
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


def held_out_sample_ids(dataset, n: int, separate_file: bool) -> list[int]:
    """Which samples are evaluated:

    * a separate held-out file (``separate_file``): its first ``n`` samples;
    * the training data (``PackedDataset``): the last ``n`` samples of its first epoch. Samples are shuffled per
      epoch, so these are a random draw of its documents that training reads only after nearly a whole epoch
      (``seen_in_training`` in the results compares with the checkpoint's consumed samples);
    * mock data (random tokens, no epoch): from sample ``MOCK_HELD_OUT_START`` on.

    Fewer than ``n`` when the epoch is shorter. Example: 1000 samples per epoch, n = 4 -> [996, 997, 998, 999]."""
    epoch = getattr(dataset, "samples_per_epoch", None)
    if epoch is None:
        return list(range(MOCK_HELD_OUT_START, MOCK_HELD_OUT_START + n))
    if separate_file:
        return list(range(min(n, epoch)))
    return list(range(max(0, epoch - n), epoch))


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


# ---- passkey -----------------------------------------------------------------------------------------------------
ID_PIECES = {"intro": (), "needle_before": (10, 11), "needle_after": (12,), "question": (13, 14),
             "filler": tuple(range(16, 64))}  # token-id prompt; digit d is token d
TEXT_PIECES = {
    "intro": "There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
             "memorize it; you will be asked about it.",
    "filler": "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
    "needle_before": "The pass key is",
    "needle_after": ". Remember it.",
    "question": "What is the pass key? The pass key is",
}


@dataclass(frozen=True)
class PasskeySample:
    tokens: torch.Tensor  # [seq_length + 1]: inputs are tokens[:-1], labels tokens[1:]
    answer_positions: tuple  # input positions whose next token is a key token
    answer: tuple  # the key's tokens
    needle_position: int  # index of the needle's first token


@dataclass(frozen=True)
class PasskeyPrompt:
    """The token pieces of a passkey prompt (see the module doc) and how a key becomes tokens."""

    intro: tuple
    filler: tuple
    needle_before: tuple
    needle_after: tuple
    question: tuple
    tokenizer: Optional[SentencePieceTokenizer] = None  # None: digit d is token d
    source: str = "token ids"

    @classmethod
    def token_ids(cls, vocab_size: int) -> "PasskeyPrompt":
        """The token-id prompt (``ID_PIECES``): ids 0-63, so the vocabulary must be larger (the end-of-document id
        of token-id data is ``vocab_size - 1``)."""
        if vocab_size <= 64:
            raise ConfigError(f"the token-id passkey prompt uses ids 0-63; model.vocab_size ({vocab_size}) must be "
                              f"larger")
        return cls(**ID_PIECES)

    @classmethod
    def from_tokenizer(cls, tokenizer: SentencePieceTokenizer, path: str) -> "PasskeyPrompt":
        return cls(**{k: tuple(tokenizer.encode(v)) for k, v in TEXT_PIECES.items()}, tokenizer=tokenizer,
                   source=f"sentencepiece {path}")

    def key_tokens(self, key: str) -> tuple[tuple, tuple]:
        """(word-boundary tokens, answer tokens) of ``key``: digit d is token d without a tokenizer; with
        SentencePiece, the encoded key, whose leading whitespace-only piece (the word boundary: ``'▁' '7' '1' ...``)
        stays in the prompt and is not scored."""
        if self.tokenizer is None:
            return (), tuple(int(c) for c in key)
        ids = tuple(self.tokenizer.encode(key))
        n = 0
        while n < len(ids) - 1 and not self.tokenizer.sp.IdToPiece(ids[n]).strip("\u2581 "):
            n += 1
        return ids[:n], ids[n:]

    def filler_tokens(self, length: int, key: str) -> int:
        """Filler tokens inside a prompt of ``length`` input tokens with ``key`` (the prompt's ``length + 1``
        tokens end with the last answer token, the label of input position ``length - 1``)."""
        boundary, answer = self.key_tokens(key)
        fixed = (len(self.intro) + len(self.needle_before) + len(self.needle_after) + len(self.question)
                 + 2 * (len(boundary) + len(answer)))
        return length + 1 - fixed

    def needle_position(self, length: int, depth: float, key: str) -> int:
        """Index of the needle's first token: after the intro and ``round(depth x filler tokens)``."""
        return len(self.intro) + int(round(depth * self.filler_tokens(length, key)))

    def check(self, length: int, depth: float, key: str, seq_length: int) -> None:
        """ConfigError when the prompt of ``length`` tokens with ``key`` cannot be built (run before any model
        is built, with a key of the length the evaluation uses)."""
        if not 0.0 <= depth <= 1.0:
            raise ConfigError(f"passkey depth {depth} must be in [0, 1] (fraction of the filler before the key)")
        if length > seq_length:
            raise ConfigError(f"passkey length {length} exceeds data.seq_length ({seq_length}); evaluate at "
                              f"--set data.seq_length={length} (a layout that divides it)")
        if self.filler_tokens(length, key) < 0:
            raise ConfigError(f"passkey length {length} is shorter than the prompt without filler "
                              f"({length - self.filler_tokens(length, key)} tokens with a {len(key)}-digit key)")

    def build(self, length: int, depth: float, key: str, seq_length: int) -> PasskeySample:
        """The prompt of ``length`` input tokens with ``key`` at ``depth``, continued with filler to
        ``seq_length``. Example (token ids), length 24, depth 0.5, key "42", filler f0 f1 ... (16 in the prompt):
        ``f0..f7 10 11 4 2 12 f8..f15 13 14 4 2 | f16 ...`` -- answer positions 22 and 23 (their labels: 4, 2)."""
        self.check(length, depth, key, seq_length)
        boundary, answer = self.key_tokens(key)
        n = self.filler_tokens(length, key)
        n1 = self.needle_position(length, depth, key) - len(self.intro)
        filler = list(itertools.islice(itertools.cycle(self.filler), n + seq_length - length))
        needle = [*self.needle_before, *boundary, *answer, *self.needle_after]
        seq = [*self.intro, *filler[:n1], *needle, *filler[n1:n], *self.question, *boundary, *answer, *filler[n:]]
        assert len(seq) == seq_length + 1
        return PasskeySample(torch.tensor(seq, dtype=torch.long), tuple(range(length - len(answer), length)), answer,
                             len(self.intro) + n1)


def passkey_key(seed: int, length: int, depth: float, trial: int, digits: int) -> str:
    """The random key of one trial, a pure function of its arguments. ``passkey_key(0, 4096, 0.5, 0, 5)`` is the
    same string on every rank and in every run."""
    rng = np.random.default_rng([seed, length, int(round(depth * 1000)), trial])
    return "".join(str(int(d)) for d in rng.integers(0, 10, digits))


def check_passkey(prompt: PasskeyPrompt, lengths: Sequence[int], depths: Sequence[float], trials: int,
                  key_digits: int, seed: int, seq_length: int) -> None:
    """ConfigError naming the first (length, depth, key) whose prompt cannot be built; cheap (no model, no
    tokens built), so a command line calls it before building the model."""
    for length, depth in itertools.product(lengths, depths):
        for t in range(trials):
            prompt.check(length, depth, passkey_key(seed, length, depth, t, key_digits), seq_length)


def passkey_batch(samples: list[PasskeySample], device: torch.device) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """Full-sequence batch of ``samples``, their answer positions and tokens ``[b, k]`` (-1 padded: keys of a
    tokenizer may have different token counts)."""
    seq = torch.stack([s.tokens for s in samples])
    b, s = seq.shape[0], seq.shape[1] - 1
    k = max(len(x.answer) for x in samples)
    positions = torch.full((b, k), -1, dtype=torch.long)
    answers = torch.full((b, k), -1, dtype=torch.long)
    for i, x in enumerate(samples):
        positions[i, :len(x.answer)] = torch.tensor(x.answer_positions)
        answers[i, :len(x.answer)] = torch.tensor(x.answer)
    batch = {"tokens": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous(),
             "position_ids": torch.arange(s).expand(b, s).contiguous()}
    return {k_: v.to(device) for k_, v in batch.items()}, positions.to(device), answers.to(device)


def evaluate_passkey(model, prompt: PasskeyPrompt, lengths: Sequence[int], depths: Sequence[float], trials: int,
                     key_digits: int, seed: int, seq_length: int, vocab_size: int, layout: Layout, topo: Topology,
                     device: torch.device) -> dict:
    """Passkey accuracy for every (length, depth): ``trials`` keys each, split over dp ranks like the samples of
    ``evaluate_positions``. Returns ``{"accuracy": [[...]], "token_accuracy": [[...]], "cells": [...]}`` (grids
    indexed [length][depth]; accuracy: every key token right; token accuracy: the fraction of key tokens right)."""
    check_passkey(prompt, lengths, depths, trials, key_digits, seed, seq_length)
    jobs = [(i, j, t) for i in range(len(lengths)) for j in range(len(depths)) for t in range(trials)]
    counts = torch.zeros(len(lengths), len(depths), 3, dtype=torch.float64)  # keys right, tokens right, tokens
    mine = jobs[topo.dp_rank::layout.dp]
    mbs = layout.micro_batch_size
    for n in range(0, len(mine), mbs):
        t0 = time.perf_counter()
        chunk = mine[n:n + mbs]
        samples = [prompt.build(lengths[i], depths[j], passkey_key(seed, lengths[i], depths[j], t, key_digits),
                                seq_length) for i, j, t in chunk]
        batch, positions, answers = passkey_batch(samples, device)
        pred = predict_tokens(model, batch, positions, layout, topo, vocab_size)
        valid = answers >= 0
        right = ((pred == answers) & valid).sum(-1).cpu()
        total = valid.sum(-1).cpu()
        for (i, j, _), r, tot in zip(chunk, right.tolist(), total.tolist()):
            counts[i, j] += torch.tensor([float(r == tot), r, tot], dtype=torch.float64)
        log.info("passkey: prompts %d-%d of %d on this dp rank (%.1f s)", n + 1, n + len(chunk), len(mine),
                 time.perf_counter() - t0)
    counts = all_reduce(counts.to(device), topo, Axis.DP).cpu()
    grid = []
    for i, length in enumerate(lengths):
        grid.append([])
        for j, depth in enumerate(depths):
            keys, right, tokens = counts[i, j].tolist()
            needle = prompt.needle_position(length, depth, passkey_key(seed, length, depth, 0, key_digits))
            grid[-1].append({"length": length, "depth": depth, "needle_position": needle, "trials": trials,
                             "accuracy": keys / trials, "token_accuracy": right / tokens})
    return {"accuracy": [[c["accuracy"] for c in row] for row in grid],
            "token_accuracy": [[c["token_accuracy"] for c in row] for row in grid],
            "cells": [c for row in grid for c in row]}
