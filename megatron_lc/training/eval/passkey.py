"""Passkey retrieval under the training layout (``tools/eval_long.py``; the forward pieces are ``evaluate.py``'s).

A prompt of ``length`` tokens: filler, a needle holding a random key of digits at ``depth`` (fraction
of the filler before it), the question, and the key as the answer::

    [intro] filler[:n1] [needle_before KEY needle_after] filler[n1:n] [question] KEY | filler ...
                                                                       ^ answer: the last tokens of the prompt

Scored teacher-forced: the model reads the prompt and, at each answer token, its argmax over the vocabulary
(``predict_tokens``, from the logits of those positions only) must be that key token. A prompt shorter than
``data.seq_length`` is continued with filler to that length, so every forward has the shape the layout was resolved
for (divisibility, FPDT chunks); tokens after the answer cannot change its logits (causal attention). Without a
tokenizer the pieces are token ids (digit d is token d; mock data and NullTokenizer); with the run's tokenizer
(``data.tokenizer_model``, SentencePiece or Hugging Face, or the demo's) they are English sentences, each piece
encoded on its own, so the key has the same tokens in the needle and in the answer.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ...config import ConfigError, Layout
from ...data.tokenizer import SentencePieceTokenizer
from ...parallel.collectives import all_reduce
from ...parallel.topology import Axis, Topology
from .by_position import predict_tokens

log = logging.getLogger("megatron_lc")


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
    tokenizer: Optional[object] = None  # a data/tokenizer.py tokenizer; None: digit d is token d
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
    def from_tokenizer(cls, tokenizer, path: str) -> "PasskeyPrompt":
        """The English prompt through ``tokenizer`` (``data/tokenizer.py``: SentencePiece or Hugging Face)."""
        kind = "sentencepiece" if isinstance(tokenizer, SentencePieceTokenizer) else "huggingface"
        return cls(**{k: tuple(tokenizer.encode(v)) for k, v in TEXT_PIECES.items()}, tokenizer=tokenizer,
                   source=f"{kind} {path}")

    def key_tokens(self, key: str) -> tuple[tuple, tuple]:
        """(word-boundary tokens, answer tokens) of ``key``: digit d is token d without a tokenizer. With a tokenizer,
        the key as a word: SentencePiece encodes it with its dummy prefix (``'▁' '7' '1' ...``), a Hugging Face
        tokenizer encodes a space and the key (Llama-3: ``'Ġ' '712' '34'``, or the space inside the first digits'
        token); leading tokens that are whitespace only are the word boundary, kept in the prompt, not scored."""
        if self.tokenizer is None:
            return (), tuple(int(c) for c in key)
        sp = isinstance(self.tokenizer, SentencePieceTokenizer)
        ids = tuple(self.tokenizer.encode(key if sp else " " + key))

        def blank(i: int) -> bool:
            text = self.tokenizer.sp.IdToPiece(i).strip("\u2581 ") if sp else self.tokenizer.decode([i]).strip()
            return not text

        n = 0
        while n < len(ids) - 1 and blank(ids[n]):
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
