"""Tokenizers: SentencePiece (trained by ``tools/train_tokenizer.py``) and a null tokenizer for mock data."""
from __future__ import annotations

import os
from typing import Iterable

import sentencepiece as spm

from .errors import DataError


class SentencePieceTokenizer:
    """Wraps a SentencePiece model. ``eod`` is the id appended after every document (the model's ``</s>``)."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise DataError(f"tokenizer model not found: {model_path} (train one with tools/train_tokenizer.py)")
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_path)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError on bad files
            raise DataError(f"{model_path}: not a SentencePiece model ({e})") from None
        self.vocab_size = self.sp.GetPieceSize()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise DataError(f"{model_path}: the SentencePiece model has no end-of-sentence id (train with eos_id)")

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds(list(int(i) for i in ids))


def train_sentencepiece(text_files: list[str], model_prefix: str, vocab_size: int, max_lines: int = 2_000_000) -> str:
    """Train a BPE SentencePiece model on the lines of ``text_files``; returns the ``.model`` path.

    Keeps whitespace runs (code), byte fallback (no unknown tokens), ids: 0 pad, 1 unk, 2 bos, 3 eos."""
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.Train(
        input=",".join(text_files), model_prefix=model_prefix, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, split_digits=True, remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, input_sentence_size=max_lines, shuffle_input_sentence=True,
        max_sentence_length=8192, pad_id=0, unk_id=1, bos_id=2, eos_id=3, num_threads=2, minloglevel=2,
        user_defined_symbols=["\n", "\t"],
    )
    return model_prefix + ".model"
