"""Data: ``tokenizer.py`` (SentencePiece), ``indexed.py`` (Megatron .bin/.idx through megatron-core's
``IndexedDataset``), ``chat.py`` (conversations: a loss mask beside the tokens), ``conversations.py`` (rendering
them with a chat template), ``dataset.py`` (packed samples, document fields, mock data), ``demo.py`` (the demo
corpus), ``errors.py`` (``DataError``)."""
from __future__ import annotations

import dataclasses
import logging

from ..config import Config
from .chat import open_loss_mask
from .dataset import MockDataset, make_batch, microbatch_sample_ids
from .errors import DataError
from .gpt import DataSplits, build_splits
from .indexed import open_indexed
from .tokenizer import build_tokenizer

__all__ = ["build_dataset", "build_tokenizer", "DataError", "DataSplits", "make_batch", "microbatch_sample_ids",
           "split_sizes", "with_tokenizer_vocab"]

log = logging.getLogger("megatron_lc")


def with_tokenizer_vocab(cfg: Config, tokenizer=None, warn: bool = True) -> Config:
    """``cfg`` with ``model.vocab_size`` the tokenizer's when unset (then padded to ``make_vocab_size_divisible_by``
    like Megatron's); a set size smaller than the tokenizer's is a one-line DataError, a larger one is said once.
    Called where a run starts (``pretrain_gpt.py``, ``tools/eval_long.py``), before the layout. Example: a Llama-3
    tokenizer (128256 ids) and no ``model.vocab_size`` -> 128256; a 2K tokenizer with ``model.vocab_size: 8000`` ->
    8000 and a warning that 6000 rows are never an input (``warn``: said by this process; one rank says it)."""
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
    if tok.vocab_size < m.vocab_size and warn:
        log.warning("model.vocab_size (%d) is larger than the tokenizer's vocabulary (%d): %d embedding rows are never "
                    "an input (unset model.vocab_size to follow the tokenizer)", m.vocab_size, tok.vocab_size,
                    m.vocab_size - tok.vocab_size)
    return cfg


def check_vocab(tok, vocab_size: int) -> None:
    """A model vocabulary smaller than the tokenizer's: one-line DataError."""
    if tok.vocab_size > vocab_size:
        raise DataError(f"the tokenizer {tok.path or type(tok).__name__} has {tok.vocab_size} tokens, more than "
                        f"model.vocab_size ({vocab_size}): unset model.vocab_size to follow the tokenizer")


def split_sizes(cfg: Config, global_batch_size: int, iteration: int = 0, consumed: int = 0) -> list[int]:
    """Samples the run reads per split (train, valid, test; 0: not built): the training samples up to
    ``train.train_iters`` -- from a checkpoint at (``iteration``, ``consumed`` samples), whatever global batch size
    it was written with -- and ``eval_iters`` global batches of the valid split when ``train.eval_interval`` is set,
    of the test split with ``test_at_end``. Example: 3 steps of 8 samples, resumed with 4 samples a step to
    ``train_iters`` 5: 24 + 2 x 4 = 32 training samples.

    Validation reads the same valid samples every time, so its losses compare across steps and resumes."""
    t = cfg.train
    train = max(t.train_iters * global_batch_size, consumed + max(t.train_iters - iteration, 0) * global_batch_size)
    return [max(train, 1), t.eval_iters * global_batch_size if t.eval_interval else 0,
            t.eval_iters * global_batch_size if t.test_at_end else 0]


def build_dataset(cfg: Config, sizes: list[int]) -> DataSplits:
    """The run's samples per split (``sizes``: ``split_sizes``), files checked before anything is built. Mock data:
    ``MockDataset`` streams; else megatron-core's blended GPTDataset splits (``gpt.py``). Every rank calls this."""
    d = cfg.data
    if d.mock_data:
        return DataSplits(*[MockDataset(d.seq_length, cfg.model.vocab_size, cfg.train.seed, i,
                                        d.mean_document_length) if n else None for i, n in enumerate(sizes)])
    blend = d.blend(cfg.model.vocab_size)
    if blend is None:
        raise DataError("data.data_path is not set (or set data.mock_data: true for random tokens)")
    indexed = [open_indexed(p) for p in blend[0]]  # the files first: a missing one is named before the tokenizer
    chat = [p for p, ds in zip(blend[0], indexed) if open_loss_mask(p, ds) is not None]  # checked against the tokens
    backend = cfg.parallel.attention_backend
    if chat and backend in ("flash", "te"):
        raise DataError(f"data.data_path {chat[0]} holds conversations (a loss mask beside its tokens), each its own "
                        f"document, with parallel.attention_backend={backend}: documents reach the kernel as "
                        f"rectangles, which the flash-attn / TransformerEngine adapters do not take; use "
                        f"attention_backend auto or torch")
    tok = build_tokenizer(d, cfg.model.vocab_size)
    check_vocab(tok, cfg.model.vocab_size)
    return build_splits(cfg, tok, sizes, indexed)
