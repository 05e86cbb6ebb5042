"""Tokenizers, all with one face: ``encode(text) -> ids``, ``decode(ids)``, ``vocab_size``, ``eod`` (the id that ends
every document), ``bos`` (None when the tokenizer has none) and ``unique_identifiers`` (megatron-core's dataset
caches are keyed by it).

* ``HuggingFaceTokenizer`` (``data.tokenizer_type: HuggingFaceTokenizer``): megatron-core's own
  (``megatron.core.tokenizers``, library ``huggingface``: transformers' AutoTokenizer on local files, never the hub).
  ``eod`` is the tokenizer's ``eos_token`` (Llama-3: ``<|end_of_text|>``), ``bos`` its ``bos_token``
  (``<|begin_of_text|>``).
* ``SentencePieceTokenizer``: a SentencePiece ``.model`` (``tools/train_tokenizer.py``, the demo); ``eod`` is ``</s>``.
* ``NullTokenizer``: megatron-core's -- ids as they are in the files, below ``data.vocab_size``; ``eod`` is
  ``data.vocab_size`` itself (Megatron-LM's rule).
"""
from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from typing import Iterable, Optional

import sentencepiece as spm

from ..config import DataConfig
from .errors import DataError

# end- and begin-of-text tokens of the known families, for a bare tokenizer.json (which does not say which is which):
# Llama-3, Llama-2 / Mistral, GPT-2 / Qwen, Gemma
EOS_NAMES = ("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _megatron_tokenizer():
    with warnings.catch_warnings():  # megatron-core warns that TE/apex are absent on CPU machines
        warnings.simplefilter("ignore")
        # megatron-core (and transformers through it) takes seconds to import: only when a tokenizer is built
        from megatron.core.tokenizers import MegatronTokenizer
    return MegatronTokenizer


class SentencePieceTokenizer:
    """Wraps a SentencePiece model. ``eod`` is the id appended after every document (the model's ``</s>``)."""

    def __init__(self, model_path: str):
        if not os.path.isfile(model_path):
            raise DataError(f"tokenizer model not found: {model_path} (train one with tools/train_tokenizer.py)")
        self.path = model_path
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(model_path)
        except Exception as e:  # noqa: BLE001 - sentencepiece raises OSError/RuntimeError on bad files
            raise DataError(f"{model_path}: not a SentencePiece model ({e})") from None
        self.vocab_size = self.sp.GetPieceSize()
        self.eod = self.sp.eos_id()
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.eod < 0:
            raise DataError(f"{model_path}: the SentencePiece model has no end-of-sentence id (train with eos_id)")
        self.unique_identifiers = OrderedDict(
            [("class", "SentencePieceTokenizer"), ("tokenizer_path", os.path.abspath(model_path)),
             ("eod", self.eod)])

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.sp.DecodeIds(list(int(i) for i in ids))


def _special_from_json(path: str) -> dict:
    """``{"eos_token": ..., "bos_token": ...}`` for a bare ``tokenizer.json``: its special added tokens that have a
    known end- / begin-of-text name (``EOS_NAMES``, ``BOS_NAMES``)."""
    try:
        with open(path, encoding="utf-8") as f:
            added = [t["content"] for t in json.load(f).get("added_tokens", []) if t.get("special", True)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(f"{path}: not a Hugging Face tokenizer.json ({type(e).__name__}: {e})") from None
    out = {}
    for key, names in (("eos_token", EOS_NAMES), ("bos_token", BOS_NAMES)):
        found = [n for n in names if n in added]
        if found:
            out[key] = found[0]
    if "eos_token" not in out:
        raise DataError(f"{path}: a bare tokenizer.json does not say which token ends a document, and it has none of "
                        f"{', '.join(EOS_NAMES)}: put it in a directory with its tokenizer_config.json (eos_token)")
    return out


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer from local files, through megatron-core's ``HuggingFaceTokenizer``.

    ``path``: a directory as transformers saves it (``tokenizer.json`` or a SentencePiece ``tokenizer.model``, with
    ``tokenizer_config.json`` naming ``bos_token`` / ``eos_token``) -- e.g. the one ``tools/convert_from_hf.py``
    writes beside an imported model -- or a ``tokenizer.json`` file (a bare one: its end-of-text token is recognised
    by name, ``EOS_NAMES``). Example, Llama-3: ``eod`` 128001 (``<|end_of_text|>``), ``bos`` 128000,
    ``vocab_size`` 128256."""

    def __init__(self, path: str):
        self.path = path
        if os.path.isfile(path):
            if os.path.basename(path) != "tokenizer.json":
                raise DataError(f"data.tokenizer_model {path}: a Hugging Face tokenizer is a directory or a file named "
                                f"tokenizer.json")
            directory = os.path.dirname(os.path.abspath(path))
            has_config = os.path.isfile(os.path.join(directory, "tokenizer_config.json"))
            special = {} if has_config else _special_from_json(path)
        elif os.path.isdir(path):
            directory, special = path, {}
            if not any(os.path.isfile(os.path.join(path, n)) for n in HF_TOKENIZER_FILES):
                raise DataError(f"{path}: no tokenizer in this directory (none of {', '.join(HF_TOKENIZER_FILES)})")
        else:
            raise DataError(f"tokenizer not found: {path} (data.tokenizer_model: a Hugging Face tokenizer directory "
                            f"or tokenizer.json)")
        try:
            self.tok = _megatron_tokenizer().from_pretrained(
                tokenizer_path=directory, metadata_path={"library": "huggingface"}, use_fast=True, **special)
        except (ValueError, OSError) as e:  # megatron-core wraps AutoTokenizer's failures in ValueError
            raise DataError(f"{path}: not a loadable Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
        self.vocab_size = int(self.tok.vocab_size)
        self.eod, self.bos = self.tok.eod, self.tok.bos
        if self.eod is None:
            raise DataError(f"{path}: the tokenizer defines no end-of-text token (eos_token in tokenizer_config.json)")
        self.unique_identifiers = OrderedDict(
            [("class", "HuggingFaceTokenizer"), ("tokenizer_path", os.path.abspath(path)), ("eod", self.eod),
             ("vocab_size", self.vocab_size)])

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` without special tokens added (no begin-of-text): Megatron-LM's ``tokenize``."""
        return self.tok.tokenize(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.detokenize([int(i) for i in ids])


class NullTokenizer:
    """megatron-core's ``NullTokenizer``: ids below ``vocab_size`` as they are; ``eod`` = ``vocab_size``."""

    def __init__(self, vocab_size: int):
        self.tok = _megatron_tokenizer().from_pretrained(metadata_path={"library": "null"}, vocab_size=vocab_size)
        self.vocab_size, self.eod, self.bos, self.path = int(self.tok.vocab_size), int(self.tok.eod), None, None
        self.unique_identifiers = OrderedDict([("class", "NullTokenizer"), ("vocab_size", self.vocab_size)])

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def tokenizer_type_of(path: str) -> str:
    """The tokenizer type a path names: a directory or a ``tokenizer.json`` is Hugging Face's, anything else a
    SentencePiece model (what ``tools/preprocess_data.py`` and ``tools/convert_to_hf.py`` assume without
    ``--tokenizer-type``).

    >>> tokenizer_type_of("runs/llama3_import/tokenizer.json"), tokenizer_type_of("data/sp.model")
    ('HuggingFaceTokenizer', 'SentencePieceTokenizer')
    """
    hf = os.path.isdir(path) or os.path.basename(path) == "tokenizer.json"
    return "HuggingFaceTokenizer" if hf else "SentencePieceTokenizer"


def build_tokenizer(d: DataConfig, vocab_size: Optional[int]):
    """The run's tokenizer (``vocab_size``: the model's, which names the demo's files), or None for mock data
    without one (its end-of-document id is then ``vocab_size - 1``: ``dataset.MockDataset``)."""
    tokenizer_model = d.files(vocab_size)[1]
    if d.tokenizer_type == "NullTokenizer":
        if d.vocab_size is None:
            if d.mock_data:
                return None
            raise DataError("data.tokenizer_type NullTokenizer needs data.vocab_size (the files' ids are below it; "
                            "the end-of-document id is data.vocab_size itself, as in Megatron-LM)")
        return NullTokenizer(d.vocab_size)
    if tokenizer_model is None:
        if d.mock_data:
            return None
        kind = "a SentencePiece .model file" if d.tokenizer_type == "SentencePieceTokenizer" else \
            "a Hugging Face tokenizer directory or tokenizer.json"
        raise DataError(f"data.tokenizer_model is not set ({kind})")
    if d.tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    return SentencePieceTokenizer(tokenizer_model)


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
