"""`data:` section: files, tokenizer, blend and split (Megatron-LM's names)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional

from .base import ConfigError, check

DEMO_DIR = "data/demo"  # relative to the working directory, like every relative path of a config
TOKENIZER_TYPES = ("SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer")


def demo_files(vocab_size: int) -> tuple[str, str]:
    """The demo corpus' own files for a vocabulary size: (``.bin/.idx`` prefix, SentencePiece model). Keyed by the
    vocabulary, so a demo run with another ``model.vocab_size`` builds its own tokenizer and data beside the others.

    >>> demo_files(8000)
    ('data/demo/stdlib_py_sp8000', 'data/demo/stdlib_py_sp8000.model')
    """
    prefix = f"{DEMO_DIR}/stdlib_py_sp{vocab_size}"
    return prefix, prefix + ".model"


def _number(x: Any) -> Optional[float]:
    if isinstance(x, bool):
        return None
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def parse_blend(data_path: Any) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """``data.data_path`` as Megatron-LM's ``--data-path`` takes it -> (prefixes, weights or None).

    One prefix, a list of prefixes (weighted by their sizes), or ``[w1, prefix1, w2, prefix2, ...]``:

    >>> parse_blend("data/web")
    (['data/web'], None)
    >>> parse_blend([0.7, "data/web", 0.3, "data/code"])
    (['data/web', 'data/code'], [0.7, 0.3])
    >>> parse_blend(["data/web", "data/code"])
    (['data/web', 'data/code'], None)
    """
    if data_path is None:
        return None
    if isinstance(data_path, str):
        words = data_path.split()  # Megatron's command line form "0.7 data/web 0.3 data/code"; else one prefix
        items = words if len(words) > 1 and _number(words[0]) is not None else [data_path]
    elif isinstance(data_path, (list, tuple)):
        items = list(data_path)
    else:
        raise ConfigError(f"data.data_path: expected a prefix or a list [weight, prefix, ...], got {data_path!r}")
    if not items:
        raise ConfigError("data.data_path is empty")
    weighted = len(items) % 2 == 0 and _number(items[0]) is not None
    if not weighted:
        numeric = [str(x) for x in items if _number(x) is not None]
        if numeric:
            raise ConfigError(f"data.data_path {items!r}: {numeric[0]} looks like a weight, but the list is not "
                              f"[weight, prefix, weight, prefix, ...]")
        return [str(x) for x in items], None
    weights, prefixes = [], []
    for i in range(0, len(items), 2):
        w, p = _number(items[i]), items[i + 1]
        if w is None:
            raise ConfigError(f"data.data_path: weight {items[i]!r} (item {i + 1}) does not parse as a number")
        if not math.isfinite(w) or w < 0:
            raise ConfigError(f"data.data_path: weight {items[i]!r} of {p} must be a finite number >= 0")
        if _number(p) is not None:
            raise ConfigError(f"data.data_path: item {i + 2} ({p!r}) should be a prefix after weight {items[i]!r}")
        weights.append(w)
        prefixes.append(str(p))
    if sum(weights) <= 0:
        raise ConfigError(f"data.data_path: the weights {weights} sum to zero")
    return prefixes, weights


def parse_split(split: str) -> list[float]:
    """``data.split`` ("969,30,1": train, valid, test parts of every prefix's documents) -> normalised fractions;
    missing parts are 0.

    >>> parse_split("969,30,1")
    [0.969, 0.03, 0.001]
    >>> parse_split("1")
    [1.0, 0.0, 0.0]
    """
    parts = [p.strip() for p in str(split).replace("/", ",").split(",")]
    if not 1 <= len(parts) <= 3 or not all(re.fullmatch(r"\d+(\.\d*)?|\.\d+", p) for p in parts):
        raise ConfigError(f"data.split {split!r} does not parse: use up to three numbers >= 0 for train, valid "
                          f"and test, e.g. 969,30,1")
    values = [float(p) for p in parts] + [0.0] * (3 - len(parts))
    if sum(values) <= 0:
        raise ConfigError(f"data.split {split!r}: the parts sum to zero")
    return [v / sum(values) for v in values]


MIXING_KEYS = ("min_length", "upsample_length", "upsample_factor")


def parse_length_mixing(mixing: Optional[dict], prefixes: list[str]) -> dict[str, dict]:
    """``data.length_mixing`` checked against the blend's ``prefixes``: ``{prefix or "*": {"min_length": N,
    "upsample_length": L, "upsample_factor": k}}`` -> the rule of each prefix (``"*"``: every prefix not named).

    >>> parse_length_mixing({"*": {"min_length": 1024}, "books": {"upsample_length": 32768, "upsample_factor": 4}},
    ...                     ["web", "books"])
    {'web': {'min_length': 1024}, 'books': {'upsample_length': 32768, 'upsample_factor': 4}}
    """
    if not mixing:
        return {}
    if not isinstance(mixing, dict):
        raise ConfigError(f"data.length_mixing: expected a mapping of prefix -> rule, got {mixing!r}")
    unknown = [k for k in mixing if k != "*" and k not in prefixes]
    if unknown:
        raise ConfigError(f"data.length_mixing names {unknown[0]!r}, which is not a prefix of data.data_path "
                          f"({', '.join(prefixes) or 'none'}; \"*\" is every prefix)")
    out = {}
    for key, rule in mixing.items():
        where = f"data.length_mixing[{key!r}]"
        if not isinstance(rule, dict) or not rule:
            raise ConfigError(f"{where}: expected a mapping with {', '.join(MIXING_KEYS)}, got {rule!r}")
        bad = [k for k in rule if k not in MIXING_KEYS]
        if bad:
            raise ConfigError(f"{where}: unknown key {bad[0]!r}; valid: {', '.join(MIXING_KEYS)}")
        for k, v in rule.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{where}.{k} ({v!r}) must be an integer >= 1")
        if ("upsample_length" in rule) != ("upsample_factor" in rule):
            raise ConfigError(f"{where}: upsample_length and upsample_factor go together")
        out[key] = dict(rule)
    return {p: out[p] if p in out else out["*"] for p in prefixes if p in out or "*" in out}


@dataclass
class DataConfig:
    seq_length: int = 512
    # Megatron's --data-path: the prefix of a .bin/.idx pair, a list of prefixes (weighted by their sizes) or a blend
    # [w1, prefix1, w2, prefix2, ...] (weights need not sum to 1); samples are drawn from each prefix in proportion
    data_path: Any = None
    # Megatron's --split: train, valid and test parts of every prefix's documents (contiguous ranges, in order)
    split: str = "969,30,1"
    # where megatron-core's sample indices are cached (built once by rank 0, read by all ranks; a directory every
    # rank can read). Unset: ``index_cache/`` beside the first prefix of data_path
    data_cache_path: Optional[str] = None
    # Megatron names. HuggingFaceTokenizer: tokenizer_model is a local directory (tokenizer.json or tokenizer.model
    # with tokenizer_config.json, as transformers saves it and tools/convert_from_hf.py copies beside an imported
    # model) or a tokenizer.json file. NullTokenizer: token ids as they are in the files (vocab_size below)
    tokenizer_type: Literal["SentencePieceTokenizer", "HuggingFaceTokenizer", "NullTokenizer"] = \
        "SentencePieceTokenizer"
    tokenizer_model: Optional[str] = None  # SentencePiece .model file, or the Hugging Face directory / tokenizer.json
    # NullTokenizer only (Megatron's --vocab-size): the files' ids are below it and the end-of-document id is
    # vocab_size itself, so the tokenizer has vocab_size + 1 ids
    vocab_size: Optional[int] = None
    mock_data: bool = False  # random tokens, no files (Megatron's --mock-data)
    # long-context mixing of the train split, per prefix of data_path (or "*": every other one): keep only documents
    # of at least min_length tokens; repeat those of at least upsample_length tokens upsample_factor times (their
    # tokens as stored). E.g. {"data/books": {"upsample_length": 32768, "upsample_factor": 4}, "*": {"min_length":
    # 1024}}. The valid and test splits keep every document. tools/data_stats.py shows the lengths of a corpus
    length_mixing: Optional[dict] = None
    # packed documents (Megatron's names): positions restart after each end-of-document token; a token attends
    # only to its own document (every attention path, every layout); no loss on end-of-document input tokens
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    # the length-weighted mean document length (sum of len^2 / sum of len: the length of the document a random token
    # sits in; tools/data_stats.py prints it for a corpus): the estimator's attention FLOPs and working memory with
    # reset_attention_mask (unset: no saving counted; training metrics count each step's own documents); with
    # mock_data, samples are packed documents of seeded long-tailed (lognormal) lengths of this length-weighted mean
    mean_document_length: Optional[int] = None
    # the demo corpus (the Python stdlib sources) and its tokenizer, built on first use under data/demo/ (demo_files);
    # data_path and tokenizer_model stay unset: files you name are never written by the demo
    prepare_demo_data: bool = False

    def __post_init__(self) -> None:
        check(self.seq_length >= 2, f"data.seq_length ({self.seq_length}) must be >= 2")
        check(self.mean_document_length is None or self.mean_document_length >= 1,
              f"data.mean_document_length ({self.mean_document_length}) must be >= 1")
        check(self.vocab_size is None or self.vocab_size >= 1, f"data.vocab_size ({self.vocab_size}) must be >= 1")
        named = [k for k in ("data_path", "tokenizer_model") if getattr(self, k) is not None]
        check(not (self.prepare_demo_data and named),
              f"data.prepare_demo_data builds the demo's own files under {DEMO_DIR}/ and never writes a path you "
              f"name: unset data.{' and data.'.join(named)}, or set data.prepare_demo_data: false to train on them")
        blend = parse_blend(self.data_path)  # one-line errors now, before any process starts
        if blend is not None and len(blend[0]) == 1 and blend[1] is None:
            self.data_path = blend[0][0]
        parse_split(self.split)
        check(not self.length_mixing or blend is not None, "data.length_mixing needs data.data_path")
        parse_length_mixing(self.length_mixing, blend[0] if blend else [])

    def files(self, vocab_size: Optional[int]) -> tuple[Optional[str], Optional[str]]:
        """(data path, tokenizer model) this run reads: the demo's for ``prepare_demo_data``, else the configured
        ones (the data path may be a blend list: ``blend``)."""
        if self.prepare_demo_data:
            return demo_files(vocab_size)
        return self.data_path, self.tokenizer_model

    def blend(self, vocab_size: Optional[int]) -> Optional[tuple[list[str], Optional[list[float]]]]:
        """(prefixes, weights or None) of the run's data (``parse_blend``); None when no data path is set."""
        return parse_blend(self.files(vocab_size)[0])

    @property
    def split_fractions(self) -> list[float]:
        return parse_split(self.split)

    @property
    def follows_tokenizer(self) -> bool:
        """True when ``model.vocab_size`` unset is the tokenizer's, which only its files say (read when the run
        starts: ``data.with_tokenizer_vocab``)."""
        return (not self.prepare_demo_data and self.tokenizer_model is not None
                and self.tokenizer_type != "NullTokenizer")
