"""Tokenizers and corpora made here for the data tests (nothing is downloaded).

* ``llama3_tokenizer(dir)``: a byte-level BPE trained with ``tokenizers`` on a few stdlib sources, with Llama-3's
  special tokens (``<|begin_of_text|>`` 0, ``<|end_of_text|>`` 1, reserved ones after) and its post-processor (a
  begin-of-text before each text when special tokens are asked for), saved as a transformers tokenizer directory;
* ``llama2_tokenizer(dir)``: a SentencePiece BPE model as a Llama-2 Hugging Face directory (``tokenizer.model`` +
  ``tokenizer_config.json``, ``<s>`` / ``</s>``);
* ``write_jsonl(path, texts)``, ``stdlib_texts(n)``: documents."""
from __future__ import annotations

import gzip
import json
import os
import sysconfig

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(6)]
NAMES = ("abc.py", "bisect.py", "colorsys.py", "heapq.py", "textwrap.py", "fnmatch.py", "keyword.py", "numbers.py")


def stdlib_texts(n: int = len(NAMES)) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [open(os.path.join(root, name), encoding="utf-8").read() for name in NAMES[:n]]


def llama3_tokenizer(path, vocab_size: int = 600) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(stdlib_texts(), trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                            eos_token="<|end_of_text|>").save_pretrained(str(path))
    return str(path)


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


def write_jsonl(path, texts, key: str = "text") -> str:
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(str(path), "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def tiny_llama3(path, vocab_size: int = 1024) -> str:
    """A random tiny Llama-3-shaped ``LlamaForCausalLM`` (2 layers, hidden 64, GQA 4/2, RoPE base 500000) with
    ``llama3_tokenizer``'s tokenizer, saved together as a Hugging Face model directory: a stand-in for a downloaded
    Llama-3 (README "Your own data")."""
    return tiny_llama_model(llama3_tokenizer(path, vocab_size))


def tiny_llama_model(path) -> str:
    """The random tiny Llama-3-shaped model of ``tiny_llama3`` for the tokenizer saved in ``path``, saved beside it."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def tiny_llama3_chat(path, vocab_size: int = 1024) -> str:
    """``tiny_llama3`` whose tokenizer carries Llama-3's chat tokens, a Llama-3-style chat template
    (``chat_util.LLAMA3_TEMPLATE``) and ``<|eot_id|>`` as its eos, as a Llama-3 Instruct's does (generation stops
    at the end of a turn): a stand-in for a downloaded Llama-3 Instruct (docs/finetune.md)."""
    from tests.support.chat_util import llama3_chat_tokenizer

    return tiny_llama_model(llama3_chat_tokenizer(path, vocab_size=vocab_size, eos="<|eot_id|>"))


if __name__ == "__main__":  # the README's stand-ins: a tiny Llama-3 and a corpus, made here
    import sys

    sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
    usage = ("usage: python tests/support/data_util.py tiny-llama3 DIR | tiny-llama3-chat DIR | corpus OUT.jsonl.gz | "
             "conversations OUT.jsonl")
    if len(sys.argv) != 3 or sys.argv[1] not in ("tiny-llama3", "tiny-llama3-chat", "corpus", "conversations"):
        sys.exit(usage)
    if sys.argv[1] == "tiny-llama3":
        print(tiny_llama3(sys.argv[2]))
    elif sys.argv[1] == "tiny-llama3-chat":
        print(tiny_llama3_chat(sys.argv[2]))
    elif sys.argv[1] == "conversations":
        from tests.support.chat_util import fixed_answer_records, write_records

        print(write_records(sys.argv[2], fixed_answer_records(2000)))
    else:
        from megatron_lc.data.demo import read_documents, stdlib_source_files

        print(write_jsonl(sys.argv[2], read_documents(stdlib_source_files())))
