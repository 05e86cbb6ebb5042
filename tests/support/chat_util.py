"""Chat templates and chat tokenizers made here for the conversation tests (nothing is downloaded): a Qwen-style Jinja
template, written after the shape of that model's own (``<|im_start|>`` / ``<|im_end|>`` with tool calls and tool
responses), a hand-written plain one, and tiny byte-level BPE tokenizers carrying them. The Llama-3-style template and
tokenizer and the conversations whose answer is one fixed sentence are the user's stand-ins (``tools/stand_ins.py``),
the same functions."""
from __future__ import annotations

from tools.stand_ins import (ANSWER, LLAMA3_TEMPLATE, fixed_answer_records, llama3_chat_tokenizer,  # noqa: F401
                             llama3_tokenizer, stdlib_texts, write_records)

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
    """``llama3_tokenizer`` with ``PLAIN_SPECIALS`` and ``PLAIN_TEMPLATE``."""
    import transformers

    llama3_tokenizer(path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": PLAIN_SPECIALS})
    tok.chat_template = PLAIN_TEMPLATE
    tok.save_pretrained(str(path))
    return str(path)
