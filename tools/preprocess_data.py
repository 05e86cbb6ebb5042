"""Tokenize documents into a Megatron ``.bin/.idx`` pair (megatron-core's IndexedDataset format, as Megatron-LM's own
``tools/preprocess_data.py`` writes it).

    python tools/preprocess_data.py --input corpus.jsonl.gz --tokenizer-type HuggingFaceTokenizer \\
        --tokenizer-model runs/llama3_import --output-prefix data/corpus --append-eod --workers 8
    python tools/preprocess_data.py --input a.txt b.txt --tokenizer-model data/sp.model --output-prefix data/x

Inputs: ``.jsonl`` and ``.jsonl.gz`` (one document per line, in the ``--json-key`` field, default ``text``); any
other file is one document. ``--tokenizer-type`` (Megatron's names): HuggingFaceTokenizer (``--tokenizer-model`` a
directory or tokenizer.json), SentencePieceTokenizer (a .model file), NullTokenizer (whitespace-separated ids below
``--vocab-size``); left out, it follows the path (a directory or tokenizer.json: Hugging Face, else SentencePiece).
``--append-eod`` ends every document with the tokenizer's end-of-document id (Llama-3: ``<|end_of_text|>``);
without it, training adds that id after each document when it reads them (``megatron_lc/data/gpt.py``).
``--workers N`` tokenizes in N processes (documents stay in input order); the progress bar counts tokens, so its
rate is tokens/s. Documents that tokenize to nothing (an empty text, a blank file) are left out and counted: the
summary (the JSON line on stdout) has ``documents`` written and ``empty_documents`` left out, and a line on stderr
says how many were left out. Exit 0 done, 2 a bad input (one line).

Conversations (``--chat``): JSONL records ``{"messages": [{"role": ..., "content": ...}, ...]}`` (``tools`` and
``tool_calls`` passed through) rendered with the tokenizer's own chat template, or ``--chat-template FILE``
(``megatron_lc/data/conversations.py``), into the tokens (``OUTPUT_PREFIX.bin/.idx``) and, beside them, their loss
mask (``OUTPUT_PREFIX.loss_mask.bin/.idx``: the assistant turns, their end-of-turn token included; ``--train-on
last-turn``: only the last). A run finds the mask by the prefix alone. A record that is not JSON, has no
``messages``, is rejected by the template, has no assistant turn or is longer than ``--max-tokens`` is left out and
counted per reason (the summary's ``left_out``, a line on stderr naming the first of each); ``--strict``: the first
one is an error instead.

    python tools/preprocess_data.py --chat --input chats.jsonl --tokenizer-model runs/llama3_import \
        --output-prefix data/chats --max-tokens 32769 --workers 4
"""
from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_lc.config import ConfigError, DataConfig  # noqa: E402
from megatron_lc.data import DataError, build_tokenizer  # noqa: E402
from megatron_lc.data.chat import loss_mask_prefix, write_conversations  # noqa: E402
from megatron_lc.data.conversations import REASONS, TRAIN_ON, BadRecord, ChatRenderer, parse_record  # noqa: E402
from megatron_lc.data.indexed import write_indexed  # noqa: E402
from megatron_lc.data.tokenizer import tokenizer_type_of  # noqa: E402

_TOKENIZER = None  # each worker process's tokenizer (set by _init_worker), or its ChatRenderer with --chat
_APPEND_EOD = False


def _open_text(path: str):
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8", errors="replace")


def iter_documents(paths, key: str):
    """The documents of ``paths`` in order, as ``(where, text, key)``: each line of a ``.jsonl`` / ``.jsonl.gz`` file
    (``key``: the JSON field to read, parsed by ``document_text`` -- in the workers), or a whole file (key None)."""
    for p in paths:
        if p.endswith((".jsonl", ".jsonl.gz")):
            with _open_text(p) as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{p}:{n}", line, key
        else:
            with _open_text(p) as f:
                yield p, f.read(), None


def document_text(item) -> str:
    """The text of one ``iter_documents`` item; a line that is not a JSON object with the key raises ValueError
    naming the file and line."""
    where, raw, key = item
    if key is None:
        return raw
    try:
        text = json.loads(raw)[key]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: not a JSON object with a '{key}' field ({type(e).__name__}: {e})") from None
    if not isinstance(text, str):
        raise ValueError(f"{where}: the '{key}' field is a {type(text).__name__}, not text")
    return text


def data_config(tokenizer_type: str | None, tokenizer_model: str | None, vocab_size: int | None) -> DataConfig:
    """The data section this tool tokenizes with (the tokenizer type inferred from the path when not given)."""
    if tokenizer_type is None:
        if tokenizer_model is None:
            raise DataError("--tokenizer-model is required (or --tokenizer-type NullTokenizer --vocab-size N)")
        tokenizer_type = tokenizer_type_of(tokenizer_model)
    return DataConfig(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model, vocab_size=vocab_size)


def _init_worker(d: DataConfig, append_eod: bool, chat: tuple = None) -> None:
    global _TOKENIZER, _APPEND_EOD
    _TOKENIZER = ChatRenderer(d.tokenizer_model, *chat) if chat else build_tokenizer(d, None)
    _APPEND_EOD = append_eod


def _encode(item) -> np.ndarray:
    """int32 ids (cheaper to send back from a worker than a list) of one ``iter_documents`` item."""
    ids = _TOKENIZER.encode(document_text(item))
    if _APPEND_EOD and ids:
        ids.append(_TOKENIZER.eod)
    return np.asarray(ids, dtype=np.int32)


def _render(item):
    """``(ids, mask)`` of one conversation record, or ``(reason, where, message)`` for one left out."""
    where, raw, key = item
    try:
        return _TOKENIZER.render(parse_record(raw, key))
    except BadRecord as e:
        return e.reason, where, str(e)


def tokenize(docs, d: DataConfig, append_eod: bool, workers: int, chunksize: int = 16, chat: tuple = None):
    """Token ids of each ``iter_documents`` item (``chat``: the ChatRenderer's arguments; ``_render``'s results),
    in order, through ``workers`` processes (they parse the JSON lines too)."""
    work = _render if chat else _encode
    if workers <= 1:
        _init_worker(d, append_eod, chat)
        yield from map(work, docs)
        return
    # one Rust thread pool per process would oversubscribe the cores the workers already use
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    with multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn").Pool(
            workers, initializer=_init_worker, initargs=(d, append_eod, chat)) as pool:
        yield from pool.imap(work, docs, chunksize=chunksize)


class Progress:
    """Counts the documents and tokens of an id stream on a tqdm bar (tokens: its rate is tokens/s; documents: its
    postfix), and the empty documents (``write_indexed`` leaves them out)."""

    def __init__(self, bar):
        self.bar, self.documents, self.empty = bar, 0, 0

    def __call__(self, ids_iter):
        for ids in ids_iter:
            self.bar.update(len(ids))
            self.documents += len(ids) > 0
            self.empty += len(ids) == 0
            if self.documents % 256 == 0:
                self.bar.set_postfix(self.postfix(), refresh=False)
            yield ids

    def postfix(self) -> dict:
        return {"docs": self.documents, **({"empty": self.empty} if self.empty else {})}

    def close(self) -> None:
        self.bar.set_postfix(self.postfix(), refresh=False)
        self.bar.close()


class ChatProgress(Progress):
    """``Progress`` over ``_render`` results: the conversations written (ids and masks passed on), their trained
    tokens, and the records left out per reason with the first of each (``strict``: that record is a DataError)."""

    def __init__(self, bar, strict: bool):
        super().__init__(bar)
        self.strict, self.trained, self.left_out, self.first = strict, 0, {}, {}

    def __call__(self, results):
        for r in results:
            if isinstance(r[0], str):  # (reason, where, message)
                reason, where, message = r
                if self.strict:
                    raise DataError(f"{where}: {message} (--strict; without it such records are counted and left out)")
                self.left_out[reason] = self.left_out.get(reason, 0) + 1
                self.first.setdefault(reason, f"{where}: {message}")
                continue
            ids, mask = r
            self.bar.update(len(ids))
            self.documents += 1
            self.trained += int(mask.sum())
            if self.documents % 256 == 0:
                self.bar.set_postfix(self.postfix(), refresh=False)
            yield ids, mask
        if not self.documents:
            raise DataError(f"no conversation to write: {self.summary_line() or 'the input has no record'}")

    def postfix(self) -> dict:
        return {"conversations": self.documents, **({"left out": sum(self.left_out.values())} if self.left_out else {})}

    def summary_line(self) -> str:
        """``2 too_long (first f.jsonl:7: ...), 1 no_messages (first ...)`` in ``REASONS`` order, or ''."""
        return ", ".join(f"{self.left_out[r]} {r} (first {self.first[r]})" for r in REASONS if r in self.left_out)


def check_chat_args(args) -> tuple:
    """The ChatRenderer's arguments of ``--chat`` (what it refuses, before any worker starts)."""
    if args.append_eod:
        raise DataError("--append-eod is for text: with --chat a conversation ends where its template ends (the next "
                        "one starts a new document when read)")
    if args.tokenizer_type not in (None, "HuggingFaceTokenizer") or (
            args.tokenizer_model is not None and tokenizer_type_of(args.tokenizer_model) != "HuggingFaceTokenizer"):
        raise DataError("--chat renders conversations with a Hugging Face tokenizer's chat template: --tokenizer-model "
                        "must be a Hugging Face tokenizer directory or tokenizer.json")
    if args.max_tokens is not None and args.max_tokens < 2:
        raise DataError(f"--max-tokens ({args.max_tokens}) must be >= 2")
    bad = [p for p in args.input if not p.endswith((".jsonl", ".jsonl.gz"))]
    if bad:
        raise DataError(f"--chat reads JSONL records (.jsonl or .jsonl.gz), not {bad[0]}")
    return args.chat_template, args.train_on, args.max_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True, help=".jsonl, .jsonl.gz or text files")
    ap.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and .idx")
    ap.add_argument("--tokenizer-type", choices=["HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer"])
    ap.add_argument("--tokenizer-model", help="Hugging Face directory or tokenizer.json, or a SentencePiece .model")
    ap.add_argument("--vocab-size", type=int, help="NullTokenizer: ids are below it, the end-of-document id is it")
    ap.add_argument("--json-key", help="the field of each JSONL line (default: text; with --chat: messages)")
    ap.add_argument("--append-eod", action="store_true", help="end every document with the end-of-document id")
    ap.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    chat = ap.add_argument_group("conversations")
    chat.add_argument("--chat", action="store_true", help="JSONL conversations rendered by the chat template; writes "
                      "the loss mask beside the tokens (OUTPUT_PREFIX.loss_mask.bin/.idx)")
    chat.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's own)")
    chat.add_argument("--train-on", choices=TRAIN_ON, default="all-turns",
                      help="which assistant turns the loss mask trains (default: all-turns)")
    chat.add_argument("--max-tokens", type=int, help="leave out (and count) conversations longer than this")
    chat.add_argument("--strict", action="store_true", help="a record that would be left out is an error instead")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    progress = None
    try:
        if args.workers < 1:
            raise DataError(f"--workers ({args.workers}) must be >= 1")
        missing = [p for p in args.input if not os.path.isfile(p)]
        if missing:
            raise DataError(f"input not found: {missing[0]}")
        chat_args = check_chat_args(args) if args.chat else None
        d = data_config(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
        tok = build_tokenizer(d, None)  # a bad tokenizer fails here, once, before any worker starts
        renderer = ChatRenderer(args.tokenizer_model, *chat_args) if args.chat else None  # and a missing template
        own_template = renderer is None or renderer.template == renderer.tok.chat_template
        key = args.json_key or ("messages" if args.chat else "text")
        t0 = time.perf_counter()
        bar = tqdm(desc="rendering" if args.chat else "tokenizing", unit="tok", unit_scale=True, mininterval=1.0)
        progress = ChatProgress(bar, args.strict) if args.chat else Progress(bar)
        docs = tokenize(iter_documents(args.input, key), d, args.append_eod, args.workers, chat=chat_args)
        if args.chat:
            n, trained = write_conversations(args.output_prefix, progress(docs))
        else:
            n = write_indexed(args.output_prefix, progress(docs))
        progress.close()
    except (DataError, ConfigError, ValueError, OSError) as e:
        if progress is not None:
            progress.bar.close()  # its last line before the error, not after it
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    summary = {"output_prefix": args.output_prefix, "documents": progress.documents,
               "empty_documents": progress.empty, "tokens": n, "seconds": round(dt, 3),
               "tokens_per_s": round(n / dt, 1), "workers": args.workers, "tokenizer": d.tokenizer_type,
               "eod": tok.eod, "append_eod": args.append_eod}
    if args.chat:
        left = sum(progress.left_out.values())
        if left:
            print(f"left out {left} of {left + progress.documents} record(s): {progress.summary_line()}",
                  file=sys.stderr, flush=True)
        if not own_template:
            print(f"note: {args.tokenizer_model} does not hold the template of --chat-template: save it there as "
                  f"chat_template.jinja so that the export (tools/convert_to_hf.py) keeps it", file=sys.stderr)
        del summary["empty_documents"], summary["append_eod"]
        summary.update(records=left + progress.documents, loss_mask=loss_mask_prefix(args.output_prefix),
                       trained_tokens=trained,
                       left_out={r: progress.left_out.get(r, 0) for r in REASONS}, train_on=args.train_on,
                       max_tokens=args.max_tokens, chat_template=args.chat_template or "the tokenizer's")
    elif progress.empty:
        print(f"left out {progress.empty} empty document(s) (no tokens): {progress.documents} written",
              file=sys.stderr, flush=True)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
