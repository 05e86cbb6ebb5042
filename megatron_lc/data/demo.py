"""The demo corpus: the Python standard library's own sources, which exist on every machine with Python.

``prepare_demo_data(data_path, tokenizer_model, vocab_size)`` trains a SentencePiece tokenizer on them and writes a
``.bin/.idx`` pair -- once; later calls find the files and return. Only rank 0 builds; others wait at a barrier."""
from __future__ import annotations

import logging
import os
import shutil
import sysconfig
import tempfile

from tqdm import tqdm

from .indexed import write_indexed
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
        log.info("training a %d-token SentencePiece tokenizer on the Python stdlib sources -> %s (about a minute "
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
    if not (os.path.isfile(data_path + ".bin") and os.path.isfile(data_path + ".idx")):
        log.info("tokenizing the Python stdlib sources -> %s.bin/.idx", data_path)
        docs = docs if docs is not None else read_documents(stdlib_source_files())
        tok = SentencePieceTokenizer(tokenizer_model)
        bar = tqdm(docs, desc="tokenizing", unit="doc", mininterval=1.0)
        n = write_indexed(data_path, (tok.encode(d) for d in bar))
        log.info("wrote %d tokens in %d documents", n, len(docs))


def _copy(src: str, dst: str) -> None:
    tmp = dst + f".tmp{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)
