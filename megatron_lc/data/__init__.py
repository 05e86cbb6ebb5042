"""Data: ``tokenizer.py`` (SentencePiece), ``indexed.py`` (Megatron .bin/.idx through megatron-core's
``IndexedDataset``), ``dataset.py`` (packed samples, document fields, mock data), ``demo.py`` (the demo corpus),
``errors.py`` (``DataError``)."""
from __future__ import annotations

from ..config import Config
from .dataset import MockDataset, PackedDataset, make_batch, microbatch_sample_ids
from .errors import DataError
from .indexed import open_indexed
from .tokenizer import SentencePieceTokenizer

__all__ = ["build_dataset", "DataError", "make_batch", "microbatch_sample_ids"]


def build_dataset(cfg: Config):
    """The dataset for ``cfg.data`` (files checked before training starts)."""
    d = cfg.data
    if d.mock_data:
        return MockDataset(d.seq_length, cfg.model.vocab_size, cfg.train.seed)
    data_path, tokenizer_model = d.files(cfg.model.vocab_size)
    if data_path is None:
        raise DataError("data.data_path is not set (or set data.mock_data: true for random tokens)")
    if d.tokenizer_type == "SentencePieceTokenizer":
        if tokenizer_model is None:
            raise DataError("data.tokenizer_model is not set (a SentencePiece .model file)")
        tok = SentencePieceTokenizer(tokenizer_model)
        if tok.vocab_size > cfg.model.vocab_size:
            raise DataError(f"tokenizer {tokenizer_model} has {tok.vocab_size} tokens, more than model.vocab_size "
                            f"({cfg.model.vocab_size})")
        eod = tok.eod
    else:
        eod = cfg.model.vocab_size - 1
    indexed = open_indexed(data_path, cfg.model.vocab_size)
    return PackedDataset(indexed, d.seq_length, cfg.train.seed, eod)
