"""The demo corpus: the Python standard library's own sources, which exist on every machine with Python.

``prepare_demo_data(data_path, tokenizer_model, vocab_size)`` trains a SentencePiece tokenizer on them and writes a
``.bin/.idx`` pair, every document ended by the tokenizer's end-of-document id (as ``tools/preprocess_data.py
--append-eod`` writes it, so reading them adds nothing and says nothing) -- once; later calls find the files and
return (a pair written by an earlier version, without those ids, is written again). Only rank 0 builds; others wait
at a barrier."""
from __future__ import annotations

import logging
import os
import shutil
import sysconfig
import tempfile

from tqdm import tqdm

from .indexed import open_indexed, write_indexed
from .tokenizer import SentencePieceTokenizer, train_sentencepiece

log = logging.getLogger(__name__)

_SKIP = {"test", "tests", "idlelib", "site-packages", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data"}


def stdlib_source_files() -> list[str]:
    """Sorted ``.py`` files of the standard library (tests and GUI packages left out)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, fs in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP and not x.startswith("__"))
        files += [os.path.join(d, f) for f in sorted(fs) if f.endswith(".py")]
    return sorted(files)


def read_documents(files: list[str]) -> list[str]:
    docs = []
    for f in tqdm(files, desc="reading the stdlib sources", unit="file", mininterval=1.0):
        try:
            with open(f, encoding="utf-8") as fh:
                docs.append(fh.read())
        except (UnicodeDecodeError, OSError):
            continue
    return docs


def prepare_demo_data(data_path: str, tokenizer_model: str, vocab_size: int) -> None:
    docs = None
    if not os.path.isfile(tokenizer_model):
        log.info("training a %d-token SentencePiece tokenizer on the Python stdlib sources -> %s (a few seconds "
                 "on 2 cores; SentencePiece reports nothing until it is done)", vocab_size, tokenizer_model)
        docs = read_documents(stdlib_source_files())
        with tempfile.TemporaryDirectory() as tmp:
            text = os.path.join(tmp, "corpus.txt")
            with open(text, "w", encoding="utf-8") as f:
                for d in docs:
                    f.write(d.rstrip("\n") + "\n")
            prefix = tokenizer_model[:-len(".model")] if tokenizer_model.endswith(".model") else tokenizer_model
            tmp_prefix = os.path.join(tmp, "tok")
            train_sentencepiece([text], tmp_prefix, vocab_size)
            os.makedirs(os.path.dirname(os.path.abspath(prefix)) or ".", exist_ok=True)
            for ext in (".vocab", ".model"):  # .model last: its presence means "done"
                _copy(tmp_prefix + ext, prefix + ext)
    tok = SentencePieceTokenizer(tokenizer_model)
    have = os.path.isfile(data_path + ".bin") and os.path.isfile(data_path + ".idx")
    if not have or not _ends_with_eod(data_path, tok.eod):
        log.info("tokenizing the Python stdlib sources -> %s.bin/.idx%s", data_path,
                 "" if not have else " (the files there were written without end-of-document ids)")
        docs = docs if docs is not None else read_documents(stdlib_source_files())
        written = []

        def with_eod(bar):
            for d in bar:
                ids = tok.encode(d)
                if ids:  # a file that tokenizes to nothing is left out
                    written.append(len(ids))
                    yield ids + [tok.eod]

        n = write_indexed(data_path, with_eod(tqdm(docs, desc="tokenizing", unit="doc", mininterval=1.0)))
        log.info("wrote %d tokens in %d documents", n, len(written))


def _ends_with_eod(data_path: str, eod: int) -> bool:
    """Whether the pair's first document ends with ``eod`` (the demo writes every document so)."""
    ds = open_indexed(data_path)  # held while its document is read: megatron-core closes the map when collected
    return int(ds[0][-1]) == eod


def _copy(src: str, dst: str) -> None:
    tmp = dst + f".tmp{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
