"""Stand-ins for downloads, made on this machine (nothing is fetched): a tiny Llama-3-shaped Hugging Face model with
its own byte-level BPE tokenizer -- a base model, or an Instruct one with Llama-3's chat tokens and a Llama-3-style
chat template --, a corpus of the Python standard library's sources, and conversations whose answer is one fixed
sentence. What docs/own_data.md and docs/finetune.md (the README's fine-tuning recipe) run on before a real model and
real data are at hand; each is written where it is told, and its path printed.

    .venv/bin/python tools/stand_ins.py tiny-llama3-chat data/llama3_chat_tiny   # a Llama-3 Instruct stand-in
    .venv/bin/python tools/stand_ins.py conversations data/chats.jsonl           # 2,000 {"messages": [...]} lines
    .venv/bin/python tools/stand_ins.py tiny-llama3 data/llama3_tiny             # a Llama-3 base stand-in
    .venv/bin/python tools/stand_ins.py corpus data/corpus.jsonl.gz              # {"text": ...} a stdlib source

The model: ``LlamaForCausalLM``, 2 layers, hidden 64, 4 query / 2 kv heads, RoPE base 500000, random weights (seed
0), and a 1,024-id tokenizer (1,027 with the chat tokens) trained on a few stdlib sources, Llama-3's special tokens
first (``<|begin_of_text|>`` 0, ``<|end_of_text|>`` 1, reserved ones after); the Instruct one ends a turn, and
generation, at ``<|eot_id|>``. The conversations: a user turn of 6-20 random words, then ``ANSWER`` (a system turn in
every third), seeded. The same bytes every time; an output that exists is refused (exit 2), never overwritten. The
tests build theirs with these functions."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.data.demo import read_documents, stdlib_source_files  # noqa: E402  (after the path)

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_special_token_{i}|>" for i in range(6)]
NAMES = ("abc.py", "bisect.py", "colorsys.py", "heapq.py", "textwrap.py", "fnmatch.py", "keyword.py", "numbers.py")

# a Llama-3-style chat template, written after the shape of that model's own: header tokens, <|eot_id|> after a turn
LLAMA3_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
    {%- set role = 'ipython' if message.role == 'tool' else message.role %}
    {{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}
    {%- if message.tool_calls %}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}
        {%- endfor %}
    {%- else %}
        {{- message.content | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

ANSWER = "The answer is always the same sentence."
WORDS = ("apple river stone cloud lamp garden window paper silver forest engine candle bridge mirror orange "
         "thunder pocket ladder marble violin").split()


def stdlib_texts(n: int = len(NAMES)) -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    return [open(os.path.join(root, name), encoding="utf-8").read() for name in NAMES[:n]]


def llama3_tokenizer(path, vocab_size: int = 600) -> str:
    """A byte-level BPE trained on ``stdlib_texts`` with Llama-3's special tokens and its post-processor (a
    begin-of-text before each text when special tokens are asked for), saved as a transformers tokenizer directory."""
    # heavy, and only the model stand-ins need them
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


def llama3_chat_tokenizer(path, template: str = LLAMA3_TEMPLATE, vocab_size: int = 600, eos: str = None) -> str:
    """``llama3_tokenizer`` with Llama-3's chat tokens (header tokens, ``<|eot_id|>``) and ``template`` (``eos``:
    another eos token, e.g. an Instruct model's ``<|eot_id|>``)."""
    import transformers  # heavy: see llama3_tokenizer

    llama3_tokenizer(path, vocab_size)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    if eos is not None:
        tok.eos_token = eos
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(path))
    return str(path)


def tiny_llama_model(path) -> str:
    """A random tiny Llama-3-shaped ``LlamaForCausalLM`` for the tokenizer saved in ``path``, saved beside it."""
    import torch  # heavy: see llama3_tokenizer
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def tiny_llama3(path, vocab_size: int = 1024) -> str:
    """``tiny_llama_model`` with ``llama3_tokenizer``'s tokenizer: a stand-in for a downloaded Llama-3."""
    return tiny_llama_model(llama3_tokenizer(path, vocab_size))


def tiny_llama3_chat(path, vocab_size: int = 1024) -> str:
    """``tiny_llama3`` whose tokenizer carries Llama-3's chat tokens, ``LLAMA3_TEMPLATE`` and ``<|eot_id|>`` as its
    eos, as a Llama-3 Instruct's does (generation stops at the end of a turn): a stand-in for a downloaded Llama-3
    Instruct."""
    return tiny_llama_model(llama3_chat_tokenizer(path, vocab_size=vocab_size, eos="<|eot_id|>"))


def fixed_answer_records(n: int, seed: int = 0, words: tuple = (6, 20)) -> list[dict]:
    """``n`` conversations: a user turn of ``words`` random words, then ``ANSWER`` (a system turn in every third)."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        messages = ([{"role": "system", "content": "Answer."}] if k % 3 == 0 else []) + [
            {"role": "user", "content": prompt}, {"role": "assistant", "content": ANSWER}]
        out.append({"messages": messages})
    return out


def write_records(path, records: list) -> str:
    """One JSON object (or a given line) a line."""
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    with open(str(path), "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def write_jsonl(path, texts, key: str = "text") -> str:
    """``{key: text}`` a line; gzip when the name ends in ``.gz``."""
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(str(path), "wt", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t}) + "\n")
    return str(path)


def stdlib_corpus(path) -> str:
    """Every source file of the Python standard library, a document a line (the demo's corpus)."""
    return write_jsonl(path, read_documents(stdlib_source_files()))


MAKERS = {"tiny-llama3-chat": tiny_llama3_chat, "tiny-llama3": tiny_llama3, "corpus": stdlib_corpus,
          "conversations": lambda path: write_records(path, fixed_answer_records(2000))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=list(MAKERS), help="what to make")
    p.add_argument("out", help="where: a directory for a model (made), a file for data")
    a = p.parse_args(argv)
    if os.path.exists(a.out) and (not os.path.isdir(a.out) or os.listdir(a.out)):
        print(f"error: {a.out} exists: give another path, or remove it first (nothing is overwritten)",
              file=sys.stderr)
        return 2
    print(MAKERS[a.kind](a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
