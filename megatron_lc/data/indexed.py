"""Megatron ``.bin/.idx`` files, read and written with megatron-core's ``IndexedDataset`` (format-compatible with
Megatron-LM's ``tools/preprocess_data.py``), with the checks a user needs before training: both files present,
header readable, ``.bin`` size matching the index (a truncated file is caught here, not mid-training)."""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from .errors import DataError


def _indexed_module():
    with warnings.catch_warnings():  # megatron-core warns that TE/apex are absent on CPU machines
        warnings.simplefilter("ignore")
        # megatron-core takes seconds to import: only when .bin/.idx files are read or written
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


LOSS_MASK_SUFFIX = ".loss_mask"  # PREFIX.loss_mask.bin/.idx: the loss mask of a conversation prefix (``chat.py``)


def write_pairs(prefixes: list[str], dtypes: list, documents) -> None:
    """Write documents to several ``.bin/.idx`` pairs at once: ``documents`` yields one array per prefix (equal
    lengths within a document, e.g. tokens and their loss mask); empty documents are left out. Written to temporary
    names and renamed at the end, last prefix first: an interrupted run leaves no half-written pair and the files
    that were there before (its temporary files are removed)."""
    mod = _indexed_module()
    tmps = [f"{p}.tmp{os.getpid()}" for p in prefixes]
    for p in prefixes:
        os.makedirs(os.path.dirname(os.path.abspath(p)) or ".", exist_ok=True)
    builders = [mod.IndexedDatasetBuilder(t + ".bin", dtype=d) for t, d in zip(tmps, dtypes)]
    try:
        for doc in documents:
            if len(doc[0]) == 0:
                continue
            for b, part, d in zip(builders, doc, dtypes):
                b.add_item(torch.as_tensor(np.require(part, dtype=d, requirements="W")))  # a read-only view: copied
                b.end_document()
        for b, t in zip(builders, tmps):
            b.finalize(t + ".idx")
    except BaseException:
        for t in tmps:
            for ext in (".bin", ".idx"):
                if os.path.exists(t + ext):
                    os.remove(t + ext)
        raise
    for p, t in reversed(list(zip(prefixes, tmps))):
        os.replace(t + ".bin", p + ".bin")
        os.replace(t + ".idx", p + ".idx")


def write_indexed(prefix: str, documents, dtype=np.int32) -> int:
    """Write token-id documents (iterable of int sequences) to ``prefix.bin/.idx``; returns the token count.

    Written to temporary names first and renamed (``write_pairs``); a conversation's loss mask left beside
    ``prefix`` by an earlier ``--chat`` run is removed (these documents are text)."""
    total = [0]

    def counted():
        for doc in documents:
            total[0] += len(doc)
            yield (doc,)

    write_pairs([prefix], [dtype], counted())
    for ext in (".bin", ".idx"):
        if os.path.exists(prefix + LOSS_MASK_SUFFIX + ext):
            os.remove(prefix + LOSS_MASK_SUFFIX + ext)
    return total[0]


class CheckedTokens:
    """An ``IndexedDataset`` whose reads are checked against the vocabulary (two compares per token read): a token
    id outside ``[0, vocab_size)`` -- a file made with another tokenizer -- is a ``DataError`` naming the file and
    where, instead of an IndexError deep in the embedding."""

    def __init__(self, ds, prefix: str, vocab_size: int):
        self.ds, self.prefix, self.vocab_size = ds, prefix, vocab_size

    def __getattr__(self, name):
        return getattr(self.ds, name)

    def get(self, doc: int, offset: int = 0, length=None) -> np.ndarray:
        tokens = self.ds.get(doc, offset=offset, length=length)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            i = int(np.flatnonzero((tokens < 0) | (tokens >= self.vocab_size))[0])
            first = int(self.ds.index.sequence_pointers[doc]) // np.dtype(self.ds.index.dtype).itemsize
            raise DataError(f"{self.prefix}.bin: token id {int(tokens[i])} at token {first + offset + i} (document "
                            f"{doc}, position {offset + i}) is outside the vocabulary (model.vocab_size "
                            f"{self.vocab_size}): the file was made with another tokenizer, or model.vocab_size is "
                            f"too small")
        return tokens


def open_indexed(prefix: str, vocab_size=None):
    """Open ``prefix.bin/.idx`` with megatron-core, after checking that the pair is complete and consistent; with
    ``vocab_size``, every read is checked against it (``CheckedTokens``)."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise DataError(f"data file not found: {prefix + ext} (data.data_path is the prefix of a .bin/.idx pair; "
                            f"make one with tools/preprocess_data.py)")
    with open(prefix + ".idx", "rb") as f:
        magic = f.read(9)
    if magic != b"MMIDIDX\x00\x00":
        raise DataError(f"{prefix}.idx: wrong header {magic!r} (expected a Megatron MMIDIDX index)")
    mod = _indexed_module()
    class Quiet(mod.IndexedDataset):  # a failed constructor leaves no fields: no __del__ traceback after our line
        def __del__(self):
            if hasattr(self, "index"):
                super().__del__()

    try:
        ds = Quiet(prefix, mmap=True)
    except Exception as e:  # noqa: BLE001 - megatron raises AssertionError/ValueError on bad indices
        raise DataError(f"{prefix}.idx: cannot be read ({type(e).__name__}: {e})") from None
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    if len(lengths) == 0:
        raise DataError(f"{prefix}: the dataset has no documents")
    itemsize = np.dtype(ds.index.dtype).itemsize
    expected = int(lengths.sum()) * itemsize
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise DataError(f"{prefix}.bin: size {actual} bytes does not match its index ({expected} bytes expected); "
                        f"the file is truncated or belongs to another index")
    return ds if vocab_size is None else CheckedTokens(ds, prefix, vocab_size)


def document_lengths(prefix: str) -> np.ndarray:
    """Every document's token count in ``prefix.bin/.idx`` (checked by ``open_indexed``), as an int64 copy: the
    dataset's own lengths view its memory map, which megatron-core closes when the dataset is collected."""
    ds = open_indexed(prefix)
    return np.array(ds.sequence_lengths, dtype=np.int64, copy=True)
