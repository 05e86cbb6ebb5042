"""`data:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check

DEMO_DIR = "data/demo"  # relative to the working directory, like every relative path of a config


def demo_files(vocab_size: int) -> tuple[str, str]:
    """The demo corpus' own files for a vocabulary size: (``.bin/.idx`` prefix, SentencePiece model). Keyed by the
    vocabulary, so a demo run with another ``model.vocab_size`` builds its own tokenizer and data beside the others.

    >>> demo_files(8000)
    ('data/demo/stdlib_py_sp8000', 'data/demo/stdlib_py_sp8000.model')
    """
    prefix = f"{DEMO_DIR}/stdlib_py_sp{vocab_size}"
    return prefix, prefix + ".model"


@dataclass
class DataConfig:
    seq_length: int = 512
    data_path: Optional[str] = None  # prefix of a Megatron .bin/.idx pair
    tokenizer_type: Literal["SentencePieceTokenizer", "NullTokenizer"] = "SentencePieceTokenizer"  # Megatron names
    tokenizer_model: Optional[str] = None  # SentencePiece .model file
    mock_data: bool = False  # random tokens, no files (Megatron's --mock-data)
    # packed documents (Megatron's names): positions restart after each end-of-document token; a token attends
    # only to its own document (every attention path, every layout); no loss on end-of-document input tokens
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # the estimator's attention FLOPs with reset_attention_mask: the length-weighted mean document length
    # (sum of len^2 / sum of len; bench/document_balance.py prints it for a corpus); unset: no saving counted.
    # Training metrics count the masked work of each step itself.
    mean_document_length: Optional[int] = None
    # the demo corpus (the Python stdlib sources) and its tokenizer, built on first use under data/demo/ (demo_files);
    # data_path and tokenizer_model stay unset: files you name are never written by the demo
    prepare_demo_data: bool = False

    def __post_init__(self) -> None:
        check(self.seq_length >= 2, f"data.seq_length ({self.seq_length}) must be >= 2")
        check(self.mean_document_length is None or self.mean_document_length >= 1,
              f"data.mean_document_length ({self.mean_document_length}) must be >= 1")
        named = [k for k in ("data_path", "tokenizer_model") if getattr(self, k) is not None]
        check(not (self.prepare_demo_data and named),
              f"data.prepare_demo_data builds the demo's own files under {DEMO_DIR}/ and never writes a path you "
              f"name: unset data.{' and data.'.join(named)}, or set data.prepare_demo_data: false to train on them")

    def files(self, vocab_size: int) -> tuple[Optional[str], Optional[str]]:
        """(data path prefix, tokenizer model) this run reads: the demo's for ``prepare_demo_data``, else the
        configured ones."""
        if self.prepare_demo_data:
            return demo_files(vocab_size)
        return self.data_path, self.tokenizer_model
