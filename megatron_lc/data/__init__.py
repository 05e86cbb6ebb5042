"""Data: ``tokenizer.py`` (SentencePiece), ``indexed.py`` (Megatron .bin/.idx through megatron-core's
``IndexedDataset``), ``dataset.py`` (packed samples, document fields, mock data), ``demo.py`` (the demo corpus),
``errors.py`` (``DataError``)."""
from __future__ import annotations

import dataclasses
import logging

from ..config import Config
from .dataset import MockDataset, PackedDataset, make_batch, microbatch_sample_ids
from .errors import DataError
from .indexed import open_indexed
from .tokenizer import build_tokenizer

__all__ = ["build_dataset", "build_tokenizer", "DataError", "make_batch", "microbatch_sample_ids",
           "with_tokenizer_vocab"]

log = logging.getLogger("megatron_lc")


def with_tokenizer_vocab(cfg: Config, tokenizer=None) -> Config:
    """``cfg`` with ``model.vocab_size`` the tokenizer's when unset (then padded to ``make_vocab_size_divisible_by``
    like Megatron's); a set size smaller than the tokenizer's is a one-line DataError, a larger one is said once.
    Called where a run starts (``pretrain_gpt.py``, ``tools/eval_long.py``), before the layout. Example: a Llama-3
    tokenizer (128256 ids) and no ``model.vocab_size`` -> 128256; a 2K tokenizer with ``model.vocab_size: 8000`` ->
    8000 and a warning that 6000 rows are never an input."""
    d = cfg.data
    if tokenizer is None:
        if not (d.follows_tokenizer or (d.tokenizer_type == "NullTokenizer" and d.vocab_size is not None)):
            return cfg  # mock data or the demo (whose tokenizer is made for model.vocab_size)
        tokenizer = build_tokenizer(d, cfg.model.vocab_size)
    tok = tokenizer
    m = cfg.model
    if m.vocab_size is None:
        return dataclasses.replace(cfg, model=dataclasses.replace(m, vocab_size=tok.vocab_size))
    check_vocab(tok, m.vocab_size)
    if tok.vocab_size < m.vocab_size:
        log.warning("model.vocab_size (%d) is larger than the tokenizer's vocabulary (%d): %d embedding rows are never "
                    "an input (unset model.vocab_size to follow the tokenizer)", m.vocab_size, tok.vocab_size,
                    m.vocab_size - tok.vocab_size)
    return cfg


def check_vocab(tok, vocab_size: int) -> None:
    """A model vocabulary smaller than the tokenizer's: one-line DataError."""
    if tok.vocab_size > vocab_size:
        raise DataError(f"the tokenizer {tok.path or type(tok).__name__} has {tok.vocab_size} tokens, more than "
                        f"model.vocab_size ({vocab_size}): unset model.vocab_size to follow the tokenizer")


def build_dataset(cfg: Config):
    """The dataset for ``cfg.data`` (files checked before training starts)."""
    d = cfg.data
    if d.mock_data:
        return MockDataset(d.seq_length, cfg.model.vocab_size, cfg.train.seed)
    data_path = d.files(cfg.model.vocab_size)[0]
    if data_path is None:
        raise DataError("data.data_path is not set (or set data.mock_data: true for random tokens)")
    indexed = open_indexed(data_path)  # the files first: a missing file is named before the tokenizer's needs
    tok = build_tokenizer(d, cfg.model.vocab_size)
    check_vocab(tok, cfg.model.vocab_size)
    return PackedDataset(indexed, d.seq_length, cfg.train.seed, tok.eod)
