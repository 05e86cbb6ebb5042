"""Conversations on disk and as samples: the tokens in ``PREFIX.bin/.idx`` as for text, and beside them their loss
mask in ``PREFIX.loss_mask.bin/.idx`` (the same megatron-core IndexedDataset format, one uint8 per token: 1 for a
token of a trained assistant turn, its end-of-turn token included; 0 for everything else). The pair beside the
tokens is how a run knows a prefix holds conversations: ``data.data_path`` names the prefix alone.

    PREFIX.bin / .idx              tokens of each conversation, as the chat template renders it (one document each)
    PREFIX.loss_mask.bin / .idx    0/1 per token, the same document lengths (checked when a run opens the prefix)

Example, a conversation rendered ``<bos> user: hi <eot> assistant: hello <eot>`` (one id per word):

    tokens     bos user: hi eot assistant: hello eot
    loss mask   0    0    0   0      0        1    1

When read, each token carries two flags (``FLAG_TRAINED``: the mask; ``FLAG_START``: the first token of a
conversation), so a sample cut from the packed stream still knows where its conversations begin. Both travel in
the high bits of the int64 values megatron-core's GPTDataset concatenates (``ChatDocuments.get``): its one index
walk reads tokens and flags together, and ``split_flags`` takes them apart.
"""
from __future__ import annotations

import os
from typing import Iterable, Optional

import numpy as np

from .errors import DataError
from .indexed import LOSS_MASK_SUFFIX, CheckedTokens, open_indexed, write_pairs


FLAG_TRAINED, FLAG_START = 1, 2  # a sample's per-token flags (uint8)
_SHIFT = 32  # token ids are below 2**31: the flags ride above them in the int64 values GPTDataset concatenates


def loss_mask_prefix(prefix: str) -> str:
    """>>> loss_mask_prefix("data/chat")
    'data/chat.loss_mask'"""
    return prefix + LOSS_MASK_SUFFIX


def has_loss_mask(prefix: str) -> bool:
    """True when a loss mask (either of its two files) lies beside the tokens of ``prefix``."""
    return any(os.path.exists(loss_mask_prefix(prefix) + ext) for ext in (".bin", ".idx"))


def open_loss_mask(prefix: str, tokens=None):
    """The loss mask beside ``prefix`` (checked like any pair: both files, header, sizes), or None for a text prefix;
    with ``tokens`` (the prefix's dataset), its documents must have the same lengths: one line if not."""
    if not has_loss_mask(prefix):
        return None
    mask = open_indexed(loss_mask_prefix(prefix))
    if np.dtype(mask.index.dtype) != np.uint8:
        raise DataError(f"{loss_mask_prefix(prefix)}.idx: a loss mask holds uint8 values, not "
                        f"{np.dtype(mask.index.dtype).name} (write it with tools/preprocess_data.py --chat)")
    if tokens is not None:
        a = np.asarray(tokens.sequence_lengths, dtype=np.int64)
        b = np.asarray(mask.sequence_lengths, dtype=np.int64)
        if a.shape != b.shape or not np.array_equal(a, b):
            bad = (f"{len(a)} documents vs {len(b)}" if a.shape != b.shape else
                   f"document {int(np.flatnonzero(a != b)[0])} has {int(a[a != b][0])} tokens vs {int(b[a != b][0])}")
            raise DataError(f"{loss_mask_prefix(prefix)} does not match the tokens of {prefix} ({bad}): write both "
                            f"with one tools/preprocess_data.py --chat run")
    return mask


def write_conversations(prefix: str, conversations: Iterable[tuple]) -> tuple[int, int]:
    """Write ``(ids, mask)`` pairs (a conversation's token ids and its 0/1 loss mask, equal lengths) to the tokens
    and the loss mask of ``prefix``; returns (tokens, trained tokens). Both pairs are written to temporary names
    and renamed at the end (the loss mask first): an interrupted run leaves what was there before."""
    counts = [0, 0]

    def documents():
        for ids, mask in conversations:
            ids, mask = np.asarray(ids), np.asarray(mask, dtype=np.uint8)
            if ids.shape != mask.shape:
                raise ValueError(f"a conversation of {ids.size} tokens has a loss mask of {mask.size}")
            counts[0] += ids.size
            counts[1] += int(mask.sum())
            yield ids, mask

    write_pairs([prefix, loss_mask_prefix(prefix)], [np.int32, np.uint8], documents())
    return counts[0], counts[1]


class ChatDocuments:
    """megatron-core's low-level dataset interface (``sequence_lengths``, ``get``, ``path_prefix``) over a
    conversation prefix: ``get`` returns ``token + (flags << 32)`` per token (flags: ``FLAG_TRAINED`` from the loss
    mask, ``FLAG_START`` on a conversation's first token), so the samples GPTDataset cuts carry them; no
    end-of-document id is added (a conversation ends where its flags say the next one starts)."""

    def __init__(self, tokens: CheckedTokens, mask):
        self.indexed, self.mask, self.path_prefix = tokens, mask, tokens.path_prefix
        self.sequence_lengths = np.asarray(tokens.sequence_lengths).astype(np.int32)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        ids = self.indexed.get(int(idx), offset=offset, length=length).astype(np.int64)
        flags = self.mask.get(int(idx), offset=offset, length=length).astype(np.int64) & FLAG_TRAINED
        if offset == 0 and flags.size:
            flags[0] |= FLAG_START
        return ids | (flags << _SHIFT)


def split_flags(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, uint8 flags) of a sample of ``ChatDocuments`` values; a padding value (negative: megatron-core
    pads a short last sample) reads as token 0 with no flag. Example: ``[5 | 1 << 33, 7 | 1 << 32]`` -> ids
    ``[5, 7]``, flags ``[FLAG_START, FLAG_TRAINED]``."""
    values = np.asarray(values, dtype=np.int64)
    real = values >= 0
    ids = np.where(real, values & ((1 << _SHIFT) - 1), 0)
    flags = np.where(real, values >> _SHIFT, 0).astype(np.uint8)
    return ids, flags
