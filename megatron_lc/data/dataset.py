"""The per-step batch schedule, batches with their document fields, and mock samples.

A dataset is anything whose ``dataset[k]`` is global sample ``k`` (``seq_length + 1`` token ids: inputs and
next-token labels), whose ``read(k)`` is those ids and the per-token flags of a conversation (None for text:
``chat.py``), and whose ``eod`` ends documents: megatron-core's GPTDataset splits (``gpt.py``) or
``MockDataset``. The data position saved in a checkpoint is the number of samples consumed.

Batch schedule: step t uses global samples ``[t*gbs, (t+1)*gbs)``; micro-batch m of dp rank d takes
``t*gbs + m*mbs*dp + d*mbs + [0, mbs)``. Every cp and tp rank of a dp replica reads the same samples and keeps its
share of the sequence (``parallel/token_layout.py``).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ..config.documents import DocumentRanges
from .chat import FLAG_START, FLAG_TRAINED


# Mock documents' lengths: lognormal with sigma 1 (a long tail: the demo corpus's length-weighted mean is 2.7x its
# mean, exp(sigma^2) = 2.7 here), its mu set so that the length-weighted mean (sum len^2 / sum len, the length of the
# document a random token sits in: what ``data.mean_document_length`` means) is the one asked for
MOCK_DOC_SIGMA = 1.0


def document_lengths(rng: np.random.Generator, n: int, mean_document_length: float,
                     length_biased: bool = False) -> np.ndarray:
    """``n`` lognormal document lengths (at least 1 token) whose length-weighted mean is ``mean_document_length``
    (for lognormal(mu, sigma): ``exp(mu + 1.5 sigma^2)``; the plain mean is that over ``exp(sigma^2)``).
    ``length_biased``: the length of the document a random token sits in (lognormal(mu + sigma^2, sigma)).
    Example: 65536 asked -> plain mean 24109, median 14624 tokens."""
    sigma = MOCK_DOC_SIGMA
    mu = np.log(mean_document_length) - 1.5 * sigma * sigma + (sigma * sigma if length_biased else 0.0)
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def mock_document_ends(rng: np.random.Generator, n_tokens: int, mean_document_length: float) -> np.ndarray:
    """Positions of the end-of-document tokens in a window of ``n_tokens`` of an endless stream of documents of
    ``document_lengths``: the window starts inside a document (length-biased, at a uniform offset) as a sample of a
    packed corpus does. Example: 8 tokens, documents of 5 (3 of them before the window), 2, 9: ends ``[1, 3]``."""
    first = document_lengths(rng, 1, mean_document_length, length_biased=True)[0]
    ends = [int(rng.integers(0, first))]  # tokens of the first document left at the window's start, less one
    plain = mean_document_length / np.exp(MOCK_DOC_SIGMA ** 2)
    while ends[-1] < n_tokens:
        more = document_lengths(rng, int(2 * (n_tokens - ends[-1]) / plain) + 8, mean_document_length)
        ends += (ends[-1] + np.cumsum(more)).tolist()
    return np.array([e for e in ends if e < n_tokens], dtype=np.int64)


class MockDataset:
    """Random tokens, a pure function of (seed, split, k): for tests and benchmarks without data files. Its
    end-of-document id is the last one of the vocabulary; random tokens hit it rarely. ``split`` 0 is the training
    stream; 1 and 2 (valid, test) are others. ``mean_document_length`` (``data.mean_document_length``): the sample
    is packed documents of seeded random lengths of that length-weighted mean (``mock_document_ends``), each ended
    by the end-of-document id, which no other token is."""

    def __init__(self, seq_length: int, vocab_size: int, seed: int, split: int = 0,
                 mean_document_length: Optional[int] = None):
        self.seq_length, self.vocab_size, self.seed, self.split = seq_length, vocab_size, seed, split
        self.eod = vocab_size - 1
        self.mean_document_length = mean_document_length

    def read(self, k: int) -> tuple[np.ndarray, None]:
        """(token ids, no flags): mock samples are text."""
        return self[k], None

    def __getitem__(self, k: int) -> np.ndarray:
        key = [self.seed, int(k)] + ([self.split] if self.split else [])
        rng = np.random.default_rng(key)
        if self.mean_document_length is None:
            return rng.integers(0, self.vocab_size, self.seq_length + 1)
        tokens = rng.integers(0, self.eod, self.seq_length + 1)
        tokens[mock_document_ends(rng, self.seq_length + 1, self.mean_document_length)] = self.eod
        return tokens


def microbatch_sample_ids(micro: int, gbs: int, mbs: int, dp: int, dp_rank: int) -> list[int]:
    """Offsets, within a step's ``gbs`` samples, of micro-batch ``micro`` on dp rank ``dp_rank``: micro-batch m
    covers ``[m*mbs*dp, (m+1)*mbs*dp)``, dp rank r its ``r``-th ``mbs`` samples."""
    base = micro * mbs * dp + dp_rank * mbs
    return list(range(base, base + mbs))


def restart_positions(is_end: torch.Tensor) -> torch.Tensor:
    """Positions ``[b, s]`` that restart at 0 after every token ``is_end`` marks (the last token of its document).
    Example, ends at 2 and 5 of 7 tokens: ``0 1 2 0 1 2 0``."""
    arange = torch.arange(is_end.shape[1]).expand_as(is_end)
    start = torch.zeros_like(arange)
    start[:, 1:] = torch.where(is_end[:, :-1], arange[:, 1:], torch.zeros_like(arange[:, 1:]))
    return arange - torch.cummax(start, dim=1).values


def document_fields(tokens: torch.Tensor, eod: int, reset_position_ids: bool, reset_attention_mask: bool,
                    eod_mask_loss: bool, loss_mask: torch.Tensor) -> dict:
    """Megatron's document options for a packed batch ``tokens [b, s]`` whose documents end with ``eod``:

    * ``reset_position_ids``: positions restart at 0 after every EOD (the EOD is its document's last token);
    * ``reset_attention_mask``: ``document_ids [b, s]`` (document index of each token; the attention lets a token
      see only its own document);
    * ``eod_mask_loss``: no loss on an EOD input token (its label is the next document's first token).

    Example, tokens ``a b EOD c d EOD e``: document_ids ``0 0 0 1 1 1 2``, position_ids ``0 1 2 0 1 2 0``, loss mask
    ``1 1 0 1 1 0 1``. Returns the fields to update the batch with."""
    is_eod = tokens == eod
    out = {}
    if reset_position_ids:
        out["position_ids"] = restart_positions(is_eod)
    if reset_attention_mask:
        out["document_ids"] = torch.cumsum(is_eod.long(), dim=1) - is_eod.long()  # the EOD belongs to its document
    if eod_mask_loss:
        out["loss_mask"] = loss_mask * (~is_eod).to(loss_mask.dtype)
    return out


def conversation_fields(tokens: torch.Tensor, flags: list, eod: int, data_cfg) -> dict:
    """The fields of a batch with at least one row of a conversation prefix (``flags[row]``: its ``seq_length + 1``
    per-token flags, ``chat.FLAG_TRAINED`` / ``FLAG_START``; None for a text row, which keeps the ``data.reset_*`` /
    ``eod_mask_loss`` rules of ``document_fields``). In a conversation row, whatever those keys say:

    * each conversation is a document: positions restart and attention stops where the next one starts;
    * the loss is on the labels of trained tokens (the assistant turns) only, and only in conversations that start
      in this row: the rest of one cut by the previous sample's end is read without its prompt, so not trained.

    Example, a sample ``a2 a3 | b1 b2 b3 b4 | c1 c2 c3`` (8 inputs and the last label; b starts at b1, c at c1, a
    was cut by the sample's start) with ``a2 a3 b3 b4`` trained: positions ``0 1 0 1 2 3 0 1`` for the inputs
    ``a2 .. c2``, document ids ``0 0 1 1 1 1 2 2``, loss mask (labels ``a3 .. c3``) ``0 0 0 1 1 0 0 0``: ``b3 b4``
    only (``a3`` ends a conversation whose prompt is in the previous sample)."""
    b, s = tokens.shape
    d = data_cfg
    is_eod = tokens == eod
    none = torch.zeros_like(is_eod)
    ends_pos, ends_doc, loss = none.clone(), none.clone(), torch.ones(b, s, dtype=torch.float32)
    for i, f in enumerate(flags):
        if f is None:  # a text row of a blend
            ends_pos[i] = is_eod[i] if d is not None and d.reset_position_ids else none[i]
            ends_doc[i] = is_eod[i] if d is not None and d.reset_attention_mask else none[i]
            if d is not None and d.eod_mask_loss:
                loss[i] = (~is_eod[i]).float()
            continue
        f = torch.from_numpy(np.asarray(f, dtype=np.int64))
        starts = (f & FLAG_START) != 0  # [s + 1]
        ends_pos[i] = ends_doc[i] = starts[1:]  # token t ends its conversation when token t + 1 starts the next
        begun = torch.cummax(starts.long(), dim=0).values[1:] > 0  # the label's conversation starts in this row
        loss[i] = (((f[1:] & FLAG_TRAINED) != 0) & begun & ~starts[1:]).float()
    cu = tuple((0, *(int(x) + 1 for x in np.flatnonzero(e[:-1].numpy())), s) for e in ends_doc)
    return {"position_ids": restart_positions(ends_pos), "loss_mask": loss,
            "document_ids": torch.cumsum(ends_doc.long(), dim=1) - ends_doc.long(), "documents": DocumentRanges(cu)}


def make_batch(dataset, sample_ids: list[int], data_cfg=None) -> dict:
    """Full-sequence batch ``{tokens, labels, position_ids: [b, s], loss_mask, sample_ids}``, with the document
    fields of ``data_cfg`` (``reset_position_ids``, ``reset_attention_mask``: ``document_ids`` and ``documents``,
    the host's ``config.DocumentRanges`` every core attention cuts its blocks by, ``eod_mask_loss``); with a
    sample of a conversation prefix (``dataset.read(k)`` gives its flags), ``conversation_fields``."""
    read = [dataset.read(k) for k in sample_ids]
    arr = np.stack([ids for ids, _ in read])
    data = torch.from_numpy(arr)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    b, s = tokens.shape
    batch = {
        "tokens": tokens,
        "labels": labels,
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        "loss_mask": torch.ones(b, s, dtype=torch.float32),
        "sample_ids": torch.tensor(sample_ids),
    }
    d = data_cfg
    if any(flags is not None for _, flags in read):  # from the host arrays, as the text rows' ranges below
        batch.update(conversation_fields(tokens, [flags for _, flags in read], dataset.eod, d))
        return batch
    if d is not None and (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        batch.update(document_fields(tokens, dataset.eod, d.reset_position_ids, d.reset_attention_mask,
                                     d.eod_mask_loss, batch["loss_mask"]))
    if d is not None and d.reset_attention_mask:  # from the host array: no device value is ever read for it
        batch["documents"] = DocumentRanges.from_eod(arr[:, :-1], dataset.eod)
    return batch
