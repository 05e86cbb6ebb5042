"""Train / valid / test samples from megatron-core's ``BlendedMegatronDatasetBuilder``: a ``GPTDataset`` per prefix
and split, blended across prefixes by ``BlendedDataset`` with the weights of ``data.data_path``.

* **Splits** (``data.split``, "969,30,1"): every prefix's documents, in file order, cut into three contiguous ranges
  (megatron-core's rule: document ``round(f * n)``). The valid split is never trained on.
* **Samples**: ``GPTDataset`` shuffles the documents of a split by ``train.seed``, concatenates them (each ends with
  the end-of-document id, ``EodDocuments``) and cuts ``data.seq_length + 1`` tokens per sample (consecutive samples
  share one token); the samples are shuffled again. ``BlendedDataset`` then draws sample ``k`` of the blend from
  the source that is furthest behind its weight (a greedy rule: the first ``n`` samples hold each source within one
  sample of ``n * weight``). Sample ``k`` is a function of the files, the split, the seed, the sequence length and
  the number of epochs the run needs (``train_iters x global batch`` samples) -- not of dp, cp, tp, FSDP or the
  micro-batch size; a run within one epoch reads the same sample ``k`` for any run length too.
* **Indices** are cached in ``data.data_cache_path`` (default ``index_cache/`` beside the first prefix): rank 0
  builds them, the other ranks wait at a barrier and read them (megatron-core's builder).
* **End of document**: files written with ``tools/preprocess_data.py --append-eod`` (or Megatron-LM's) end every
  document with the tokenizer's end-of-document id; in files written without it, that id is added after each
  document when it is read (``EodDocuments``), so packed documents are always separated.

What is ours and why: ``EodDocuments`` (megatron-core's GPTDataset reads documents as the files hold them), the split
adapter ``SplitSamples`` (our batches carry document ids for the attention masks, which GPTDataset does not make:
``dataset.document_fields`` computes them from the tokens), the vocabulary check of every read
(``indexed.CheckedTokens``: a token id outside ``model.vocab_size`` is one line naming the file and the position,
not an IndexError in the embedding), and ``_single_process_rank``: megatron-core 0.16's
``BlendedDataset`` asks ``torch.distributed.get_rank()`` on a cache miss, which fails in a run without a process
group (one CPU process), so the build answers rank 0 there.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import numpy as np
import torch.distributed as dist

from ..config import Config
from ..config.data import parse_length_mixing
from .chat import ChatDocuments, has_loss_mask, open_loss_mask, split_flags
from .errors import DataError
from .indexed import CheckedTokens

log = logging.getLogger("megatron_lc")
SPLITS = ("train", "valid", "test")


def _megatron_datasets():
    with warnings.catch_warnings():  # megatron-core warns that TE/apex are absent on CPU machines
        warnings.simplefilter("ignore")
        # megatron-core takes seconds to import: only when data files are read
        from megatron.core.datasets import blended_megatron_dataset_builder as builder
        from megatron.core.datasets import gpt_dataset
    return builder, gpt_dataset


# ---- documents, each ended by the end-of-document id --------------------------------------------------------------
def _missing_eod(indexed, eod: int, cache_dir: str) -> np.ndarray:
    """Bool per document: its last token is not ``eod``. One read of every document's last token, cached in
    ``cache_dir`` under a key of the files (path, sizes, modification times) and ``eod``."""
    prefix = indexed.path_prefix
    stat = [(os.path.getsize(prefix + e), os.stat(prefix + e).st_mtime_ns) for e in (".bin", ".idx")]
    key = hashlib.md5(repr((os.path.abspath(prefix), stat, eod)).encode(), usedforsecurity=False).hexdigest()
    path = os.path.join(cache_dir, f"{key}-missing_eod.npy")
    if os.path.isfile(path):
        return np.load(path)
    lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
    dtype = np.dtype(indexed.index.dtype)
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    last = tokens[np.asarray(indexed.index.sequence_pointers, dtype=np.int64) // dtype.itemsize + lengths - 1]
    missing = np.asarray(last != eod)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.npy"  # every rank may compute it at once: each writes whole, then renames
    np.save(tmp, missing)
    os.replace(tmp, path)
    return missing


class EodDocuments:
    """megatron-core's low-level dataset interface (``sequence_lengths``, ``get``, ``path_prefix``) over an
    ``IndexedDataset`` whose documents may lack the end-of-document id: such a document is read with ``eod``
    after its last token. Example, eod 9: a file holding ``[5 6] [7 9]`` reads as ``[5 6 9] [7 9]``."""

    def __init__(self, indexed, eod: int, cache_dir: str):
        self.indexed, self.eod, self.path_prefix = indexed, eod, indexed.path_prefix
        self.added = _missing_eod(indexed, eod, cache_dir)
        self.sequence_lengths = (np.asarray(indexed.sequence_lengths, dtype=np.int64) + self.added).astype(np.int32)
        if self.added.any():
            log.info("%s: %d of %d documents end without the end-of-document id %d; it is added after each when read "
                     "(tools/preprocess_data.py --append-eod writes it)", self.path_prefix, int(self.added.sum()),
                     len(self.added), eod)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        idx = int(idx)
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        if not self.added[idx]:
            return self.indexed.get(idx, offset=offset, length=length)
        stored = int(self.sequence_lengths[idx]) - 1  # the file's tokens; the eod follows them
        take = max(0, min(length, stored - offset))
        part = self.indexed.get(idx, offset=offset, length=take) if take else np.empty(0, np.int64)
        if offset + length > stored:
            part = np.concatenate([part.astype(np.int64), np.array([self.eod], np.int64)])
        return part


def mixed_documents(lengths: np.ndarray, documents: np.ndarray, rule: dict) -> np.ndarray:
    """The train split's ``documents`` after a ``data.length_mixing`` rule (``lengths``: every document's tokens as
    stored): those shorter than ``min_length`` dropped, those of at least ``upsample_length`` repeated
    ``upsample_factor`` times (each copy is shuffled like any document).

    >>> mixed_documents(np.array([5, 50, 500]), np.arange(3), {"min_length": 10, "upsample_length": 100,
    ...                                                        "upsample_factor": 3}).tolist()
    [1, 2, 2, 2]
    """
    n = lengths[documents]
    keep = n >= rule.get("min_length", 0)
    reps = np.where(n >= rule.get("upsample_length", np.inf), rule.get("upsample_factor", 1), 1)
    return np.repeat(documents[keep], reps[keep]).astype(documents.dtype)


def _document_dataset_class():
    builder, gpt = _megatron_datasets()
    train = builder.Split.train

    class DocumentDataset(gpt.GPTDataset):
        """megatron-core's GPTDataset over ``EodDocuments``; the train split's documents after the prefix's
        ``data.length_mixing`` rule (``config.length_mixing``, part of the index cache's key); a conversation
        prefix (a loss mask beside its tokens, ``chat.py``) read by ``ChatDocuments``."""

        def __init__(self, low_level, dataset_path, indices, num_samples, index_split, config):
            rule = config.length_mixing.get(dataset_path)
            if rule and index_split == train:
                indices = mixed_documents(np.asarray(low_level.indexed.sequence_lengths), indices, rule)
            super().__init__(low_level, dataset_path, indices, num_samples, index_split, config)

        @staticmethod
        def build_low_level_dataset(dataset_path, config):
            indexed = gpt.GPTDataset.build_low_level_dataset(dataset_path, config)
            # every read checked against the model's vocabulary (a file made with another tokenizer: one line)
            checked = CheckedTokens(indexed, dataset_path, config.model_vocab_size)
            if has_loss_mask(dataset_path):  # conversations: tokens and their loss mask read together
                return ChatDocuments(checked, open_loss_mask(dataset_path, indexed))
            return EodDocuments(checked, config.tokenizer.eod, config.path_to_cache)

        @staticmethod
        def _key_config_attributes():
            return gpt.GPTDataset._key_config_attributes() + ["length_mixing", "conversations"]

    return DocumentDataset


# ---- what the loop reads ---------------------------------------------------------------------------------------
class SplitSamples:
    """Global sample ``k`` of one split: ``seq_length + 1`` token ids (``dataset[k]``), with the per-token flags of
    a conversation prefix (``read(k)``: ids and flags, None for text; ``chat.py``), ``eod``, ``len()``, and
    ``source(k)``: the index of the blend's prefix it came from."""

    def __init__(self, ds, eod: int, split: str, prefixes: list[str], chat: Optional[list[bool]] = None):
        self.ds, self.eod, self.split, self.prefixes = ds, eod, split, prefixes
        self.chat = chat or [False] * len(prefixes)

    def __len__(self) -> int:
        return len(self.ds)

    def _item(self, k: int) -> dict:
        if not 0 <= k < len(self.ds):
            raise DataError(f"sample {k} of the {self.split} split does not exist: it has {len(self.ds)} samples "
                            f"(built for the run's train_iters x global batch size)")
        return self.ds[k]

    def read(self, k: int) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(token ids, flags or None) of sample ``k``: flags (``chat.FLAG_TRAINED`` / ``FLAG_START``) for a sample of
        a conversation prefix, None for text."""
        s = self._item(int(k))  # GPTDataset: tokens = text[:-1], labels = text[1:]
        values = np.concatenate([s["tokens"].numpy(), s["labels"][-1:].numpy()])
        return split_flags(values) if self.chat[int(s.get("dataset_id", 0))] else (values, None)

    def __getitem__(self, k: int) -> np.ndarray:
        return self.read(k)[0]

    def source(self, k: int) -> int:
        return int(self._item(int(k)).get("dataset_id", 0))


@dataclass
class DataSplits:
    """The run's samples per split (None: a split the run does not read)."""

    train: object
    valid: Optional[object] = None
    test: Optional[object] = None


# ---- building ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _single_process_rank():
    """megatron-core's BlendedDataset calls ``torch.distributed.get_rank()`` on a cache miss even without a process
    group; in a single process that is rank 0."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with mock.patch.object(dist, "get_rank", lambda *a, **k: 0):
        yield


def split_documents(n: int, fractions: list[float]) -> list[int]:
    """Documents per split of a prefix with ``n`` documents (megatron-core's ``round(f * n)`` book-ends).

    >>> split_documents(1000, [0.969, 0.03, 0.001])
    [969, 30, 1]
    """
    ends = np.round(np.cumsum([0.0] + fractions) * n).astype(int)
    return [int(b - a) for a, b in zip(ends[:-1], ends[1:])]


def build_splits(cfg: Config, tokenizer, sizes: list[int], indexed: list) -> DataSplits:
    """The blended ``GPTDataset`` splits of ``cfg.data`` with ``sizes`` samples (train, valid, test; 0: not built);
    ``indexed``: the blend's prefixes opened (``indexed.open_indexed``: checked). Every rank calls this
    (megatron-core's builder synchronises them); everything that can be wrong is checked on every rank first, so
    it is the same one-line DataError everywhere, before any barrier."""
    d = cfg.data
    prefixes, weights = d.blend(cfg.model.vocab_size)
    if weights is None:  # a list of prefixes: weighted by their sizes in tokens
        weights = [float(np.asarray(ds.sequence_lengths, dtype=np.int64).sum()) for ds in indexed]
    fractions = d.split_fractions
    for name, size, frac in zip(SPLITS, sizes, fractions):
        if size and frac == 0:
            raise DataError(f"the {name} split is empty: data.split {d.split!r} gives it no documents")
        for p, ds, w in zip(prefixes, indexed, weights):
            if size and w > 0 and split_documents(len(ds.sequence_lengths), fractions)[SPLITS.index(name)] == 0:
                raise DataError(f"the {name} split of {p} is empty: data.split {d.split!r} gives none of its "
                                f"{len(ds.sequence_lengths)} documents to {name}")
    mixing = parse_length_mixing(d.length_mixing, prefixes)
    for p, ds in zip(prefixes, indexed):  # checked on every rank: the builder runs on rank 0 first
        if p in mixing and sizes[0]:
            lengths = np.asarray(ds.sequence_lengths)
            n_train = split_documents(len(lengths), fractions)[0]
            if not len(mixed_documents(lengths, np.arange(n_train), mixing[p])):
                raise DataError(f"data.length_mixing leaves no document in the train split of {p}: none of its "
                                f"{n_train} has {mixing[p]['min_length']} tokens or more (the longest has "
                                f"{int(lengths[:n_train].max()) if n_train else 0})")
    kept = [(p, w) for p, w in zip(prefixes, weights) if w > 0]  # a zero weight: the prefix is not read
    cache = d.data_cache_path or os.path.join(os.path.dirname(os.path.abspath(prefixes[0])), "index_cache")
    builder_mod, gpt = _megatron_datasets()
    config = gpt.GPTDatasetConfig(
        random_seed=cfg.train.seed, sequence_length=d.seq_length, split=d.split,
        blend=([p for p, _ in kept], [w for _, w in kept] if len(kept) > 1 else None),
        path_to_cache=cache, tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False)  # document fields: dataset.document_fields
    for i, size in enumerate(sizes):
        if not size:  # a split the run does not read is not built
            config.split_matrix[i] = None
    config.length_mixing = mixing  # DocumentDataset's rule per prefix, and part of its cache key
    # which prefixes hold conversations (no end-of-document id added: other lengths), also part of the key
    config.conversations = sorted(p for p, _ in kept if has_loss_mask(p))
    config.model_vocab_size = cfg.model.vocab_size  # the token ids DocumentDataset reads must be below it
    with _single_process_rank(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's pad-id warnings: our samples are never padded
        built = builder_mod.BlendedMegatronDatasetBuilder(
            _document_dataset_class(), list(sizes), lambda: True, config).build()
    names = [p for p, _ in kept]
    chat = [has_loss_mask(p) for p in names]
    return DataSplits(*[SplitSamples(ds, tokenizer.eod, name, names, chat) if ds is not None else None
                        for name, ds in zip(SPLITS, built)])
