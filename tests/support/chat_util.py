"""Chat templates and chat tokenizers made here for the conversation tests and the fine-tuning recipe (nothing is
downloaded): a Llama-3-style and a Qwen-style Jinja template, written after the shape of those models' own (header
tokens and ``<|eot_id|>``; ``<|im_start|>`` / ``<|im_end|>`` with tool calls and tool responses), and tiny byte-level
BPE tokenizers carrying them; conversations whose answer is one fixed sentence after a random prompt."""
from __future__ import annotations

import json
import os
import random

from tests.support.data_util import llama3_tokenizer, stdlib_texts

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

QWEN_TEMPLATE = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.' }}
{%- endif %}
{%- if tools %}
    {{- '\\n\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
    {{- '\\n</tools>' }}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role in ['user', 'system'] %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": '
                + (call.function.arguments | tojson) + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# a hand-written one: every turn is <|role|>content<|end|>
PLAIN_TEMPLATE = ("{% for m in messages %}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{% endfor %}"
                  "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
PLAIN_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def llama3_chat_tokenizer(path, template: str = LLAMA3_TEMPLATE, vocab_size: int = 600, eos: str = None) -> str:
    """``data_util.llama3_tokenizer`` with Llama-3's chat tokens (header tokens, ``<|eot_id|>``) and ``template``
    (``eos``: another eos token, e.g. an Instruct model's ``<|eot_id|>``)."""
    import transformers

    llama3_tokenizer(path, vocab_size)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    if eos is not None:
        tok.eos_token = eos
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(str(path))
    return str(path)


def qwen_chat_tokenizer(path, template: str = QWEN_TEMPLATE, vocab_size: int = 600) -> str:
    """A byte-level BPE with Qwen's special tokens (``<|endoftext|>`` padding, ``<|im_start|>``, ``<|im_end|>`` the
    end of a turn and the eos, as an instruct model's) and ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(stdlib_texts(), trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>")
    fast.chat_template = template
    fast.save_pretrained(str(path))
    return str(path)


def plain_chat_tokenizer(path) -> str:
    """``data_util.llama3_tokenizer`` with ``PLAIN_SPECIALS`` and ``PLAIN_TEMPLATE``."""
    import transformers

    llama3_tokenizer(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": PLAIN_SPECIALS})
    tok.chat_template = PLAIN_TEMPLATE
    tok.save_pretrained(str(path))
    return str(path)


ANSWER = "The answer is always the same sentence."
WORDS = ("apple river stone cloud lamp garden window paper silver forest engine candle bridge mirror orange "
         "thunder pocket ladder marble violin").split()


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
    os.makedirs(os.path.dirname(os.path.abspath(str(path))), exist_ok=True)
    with open(str(path), "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)
