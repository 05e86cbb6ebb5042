"""Tokenizers and corpora made here for the data tests (nothing is downloaded).

* ``llama3_tokenizer(dir)``, ``tiny_llama3(dir)``, ``tiny_llama3_chat(dir)``, ``write_jsonl(path, texts)``,
  ``stdlib_texts(n)``: the user's stand-ins (``tools/stand_ins.py``), the same functions;
* ``llama2_tokenizer(dir)``: a SentencePiece BPE model as a Llama-2 Hugging Face directory (``tokenizer.model`` +
  ``tokenizer_config.json``, ``<s>`` / ``</s>``)."""
from __future__ import annotations

import json
import os

from tools.stand_ins import (llama3_tokenizer, stdlib_texts, tiny_llama3, tiny_llama3_chat,  # noqa: F401
                             tiny_llama_model, write_jsonl)


def llama2_tokenizer(path, vocab_size: int = 500) -> str:
    from megatron_lc.data.tokenizer import train_sentencepiece

    os.makedirs(path, exist_ok=True)
    corpus = os.path.join(str(path), "corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(stdlib_texts()))
    model = train_sentencepiece([corpus], os.path.join(str(path), "sp"), vocab_size)
    os.replace(model, os.path.join(str(path), "tokenizer.model"))
    for extra in (corpus, os.path.join(str(path), "sp.vocab")):
        os.remove(extra)
    with open(os.path.join(str(path), "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "add_bos_token": True, "add_eos_token": False, "legacy": False}, f)
    return str(path)
