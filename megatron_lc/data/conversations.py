"""Conversations rendered by a tokenizer's own chat template into token ids and a loss mask
(``tools/preprocess_data.py --chat``; the files: ``chat.py``).

A record is a JSON object with ``messages: [{role, content}, ...]`` (Hugging Face / OpenAI shape: ``system``,
``user``, ``assistant`` and tool turns, ``tool_calls`` inside an assistant turn, an optional top-level ``tools``
list), all passed to transformers' ``apply_chat_template`` as they are. The mask marks the tokens of the assistant
turns (every one, or only the last: ``train_on``), their end-of-turn token included, found without knowing the
template:

    before  = render(messages[:i], add_generation_prompt=True)  # ... <|start_header_id|>assistant<|end_header_id|>
    through = render(messages[:i + 1])                          # ... the answer<|eot_id|>
    turn i  = characters [len(before), len(through)) of the whole conversation's rendering

less whitespace after a closing special token (Qwen's ``<|im_end|>\\n``: the newline is never generated). The whole
rendering is tokenized in pieces cut where each trained turn starts and ends, so an answer follows exactly the
tokens of its generation prompt, as ``generate`` sees them after ``apply_chat_template(...,
add_generation_prompt=True)``. Where the tokenizer splits at those places anyway (special tokens; Llama-3's and
Qwen's pre-tokenizers keep a run of newlines whole) the ids are exactly ``apply_chat_template(messages,
tokenize=True)``'s; a GPT-2-style byte-level split tokenizes a prompt's trailing two newlines as one token but as
two before a word, and the pieces keep the generation prompt's. A template that renders an earlier turn differently
once later turns follow (one that drops earlier reasoning) has no such turn: the record is refused as a template
error, and ``train_on="last-turn"`` trains it.

Example, a hand-written template ``{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}``
(``add_generation_prompt`` adds ``<|assistant|>``) on ``[user "hi", assistant "yo"]``: the rendering
``<|user|>hi<|end|><|assistant|>yo<|end|>``, trained ``yo<|end|>``.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import numpy as np

from .errors import DataError

TRAIN_ON = ("all-turns", "last-turn")
# why a record is left out (counted per reason by the tool; --strict: the first one is an error)
REASONS = ("not_json", "no_messages", "template_error", "no_assistant", "too_long")


class BadRecord(ValueError):
    """A record left out: ``reason`` (one of ``REASONS``) and a one-line ``message``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def parse_record(raw: str, key: str = "messages") -> dict:
    """``{"messages": [...], "tools": [...] or None}`` of one JSONL line; ``BadRecord`` if it is not a JSON object
    with a non-empty list of turns (objects with a string ``role``) under ``key``."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        raise BadRecord("not_json", f"not JSON ({e})") from None
    if not isinstance(record, dict):
        raise BadRecord("not_json", f"not a JSON object (a {type(record).__name__})")
    messages = record.get(key)
    if messages is None:
        raise BadRecord("no_messages", f"no '{key}' field (a list of {{role, content}} turns)")
    if not (isinstance(messages, list) and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise BadRecord("no_messages", f"'{key}' is not a non-empty list of {{role, content}} objects")
    return {"messages": messages, "tools": record.get("tools")}


def load_hf_tokenizer(path: str):
    """transformers' fast tokenizer of ``path`` (a directory as transformers saves it, or a tokenizer.json): the one
    ``data.tokenizer_type: HuggingFaceTokenizer`` reads the same files with."""
    # transformers takes seconds to import: only when conversations are rendered
    import transformers

    try:
        if os.path.isfile(path):
            tok = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
        else:
            tok = transformers.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a loadable Hugging Face tokenizer ({str(e).splitlines()[0]})") from None
    if not tok.is_fast:
        raise DataError(f"{path}: --chat needs a fast tokenizer (a tokenizer.json)")
    return tok


def chat_template(tok, path: str, template_file: Optional[str]) -> str:
    """The template to render with: ``template_file``'s text when given, else the tokenizer's own; one line if
    neither exists."""
    if template_file is not None:
        try:
            with open(template_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise DataError(f"--chat-template {template_file}: {e.strerror}") from None
    if not isinstance(getattr(tok, "chat_template", None), str) or not tok.chat_template:
        raise DataError(f"the tokenizer {path} has no chat template: pass --chat-template FILE (a Jinja chat "
                        f"template), or use the tokenizer of a chat model")
    return tok.chat_template


class ChatRenderer:
    """Renders records into ``(ids int32, mask uint8)`` (module doc); ``max_tokens``: a longer conversation is a
    ``BadRecord`` ("too_long")."""

    def __init__(self, tokenizer_path: str, template_file: Optional[str] = None, train_on: str = "all-turns",
                 max_tokens: Optional[int] = None):
        if train_on not in TRAIN_ON:
            raise DataError(f"train_on {train_on!r}: expected one of {', '.join(TRAIN_ON)}")
        self.tok = load_hf_tokenizer(tokenizer_path)
        self.template = chat_template(self.tok, tokenizer_path, template_file)
        self.train_on, self.max_tokens = train_on, max_tokens
        self.specials = sorted({t.content for t in self.tok.added_tokens_decoder.values() if t.special}
                               | set(self.tok.all_special_tokens), key=len, reverse=True)

    def text(self, messages: list, tools, generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # noqa: BLE001 - the template's own errors (raise_exception, jinja2's) on a record
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise BadRecord("template_error", f"the chat template rejects it ({first})") from None

    def turn_span(self, messages: list, tools, i: int, whole: str) -> tuple[int, int]:
        """Characters of assistant turn ``i`` in ``whole`` (the conversation's rendering)."""
        before = self.text(messages[:i], tools, True)
        through = self.text(messages[:i + 1], tools, False)
        if not (through.startswith(before) and whole.startswith(through)):
            raise BadRecord("template_error", f"the chat template renders assistant turn {i} differently once later "
                                              f"turns follow (train on the last turn only: --train-on last-turn)")
        end = len(through)
        kept = through.rstrip()
        if len(kept) > len(before) and any(kept.endswith(s) for s in self.specials):
            end = len(kept)  # whitespace after the end-of-turn token is never generated
        return len(before), end

    def render(self, record: dict) -> tuple[np.ndarray, np.ndarray]:
        messages, tools = record["messages"], record.get("tools")
        whole = self.text(messages, tools, False)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise BadRecord("no_assistant", f"no assistant turn (roles: {', '.join(m['role'] for m in messages)})")
        spans = [self.turn_span(messages, tools, i, whole)
                 for i in (turns if self.train_on == "all-turns" else turns[-1:])]
        cuts = sorted({0, len(whole), *(c for span in spans for c in span)})
        ids, mask = [], []
        for a, b in zip(cuts[:-1], cuts[1:]):  # a piece is all prompt or one whole trained turn
            piece = self.tok(whole[a:b], add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [int((a, b) in spans)] * len(piece)
        ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)
        if self.max_tokens is not None and ids.size > self.max_tokens:
            raise BadRecord("too_long", f"{ids.size} tokens, more than --max-tokens {self.max_tokens}")
        if not mask.any():
            raise BadRecord("no_assistant", "its assistant turns render to no token")
        return ids, mask
