"""Conversations: rendered by the tokenizer's own chat template into the ids ``apply_chat_template`` gives and a loss
mask that is exactly the assistant turns (a hand-written template, a Llama-3-style and a Qwen-style one with tool
calls, all written in tests/support/chat_util.py); ``tools/preprocess_data.py --chat`` counting or refusing bad
records in one line; a run finding the mask by the prefix alone, through blends with text."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megatron_lc.config import load_config
from megatron_lc.data import DataError, build_dataset, make_batch, split_sizes
from megatron_lc.data.chat import loss_mask_prefix, write_conversations
from megatron_lc.data.conversations import ChatRenderer
from megatron_lc.data.indexed import document_lengths, open_indexed, write_indexed, write_pairs
from tests.support.chat_util import (llama3_chat_tokenizer, plain_chat_tokenizer, qwen_chat_tokenizer,
                                     write_records)
from tools import preprocess_data

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is up?"},
                {"role": "assistant", "content": "Nothing much."}, {"role": "user", "content": "And then?"},
                {"role": "assistant", "content": "Then more, 42 times."}]
ANSWERS = ["Nothing much.", "Then more, 42 times."]
END = {"plain": "<|end|>", "llama3": "<|eot_id|>", "qwen": "<|im_end|>"}
TOOL_CALL = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "content": "18C and sunny"}, {"role": "assistant", "content": "It is 18C."}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizers")
    return {"plain": plain_chat_tokenizer(d / "plain"), "llama3": llama3_chat_tokenizer(d / "llama3"),
            "qwen": qwen_chat_tokenizer(d / "qwen")}


def trained_text(tok, ids, mask) -> list[str]:
    """The decoded runs of consecutive trained tokens."""
    runs, run = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            run.append(i)
        elif run:
            runs, run = runs + [tok.decode(run)], []
    return runs + ([tok.decode(run)] if run else [])


def template_ids(tok, messages, **kw) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_hand_written_template_mask_is_the_assistant_spans(tokenizers):
    """Every turn of PLAIN_TEMPLATE is ``<|role|>content<|end|>``, its special tokens cut the text, so the mask
    is known piece by piece: ones on each assistant content and its ``<|end|>``, zeros elsewhere."""
    r = ChatRenderer(tokenizers["plain"])
    ids, mask = r.render({"messages": CONVERSATION})
    expected_ids, expected_mask = [], []
    for m in CONVERSATION:
        for text, trained in ((f"<|{m['role']}|>", 0), (m["content"], m["role"] == "assistant"),
                              ("<|end|>", m["role"] == "assistant")):
            piece = r.tok(text, add_special_tokens=False)["input_ids"]
            expected_ids += piece
            expected_mask += [int(trained)] * len(piece)
    assert ids.tolist() == expected_ids == template_ids(r.tok, CONVERSATION)
    assert mask.tolist() == expected_mask


@pytest.mark.parametrize("name", ["llama3", "qwen"])
def test_model_templates_train_each_answer_and_its_end_of_turn_token(tokenizers, name):
    r = ChatRenderer(tokenizers[name])
    ids, mask = r.render({"messages": CONVERSATION})
    assert r.tok.decode(ids.tolist()) == r.tok.apply_chat_template(CONVERSATION, tokenize=False)
    # the first answer follows exactly the tokens generate is given (the generation prompt, tokenized whole)
    prompt = template_ids(r.tok, CONVERSATION[:2], add_generation_prompt=True)
    assert ids[:len(prompt)].tolist() == prompt and mask[:len(prompt)].sum() == 0 and mask[len(prompt)] == 1
    if name == "qwen":  # its newline comes before the answer's first word: tokenized whole, the same ids
        assert ids.tolist() == template_ids(r.tok, CONVERSATION)
    else:  # the stand-in's GPT-2 split makes the prompt's "\n\n" one token, but two before a word when whole
        whole = template_ids(r.tok, CONVERSATION)
        assert len(whole) == len(ids) + 2 and r.tok.decode(whole) == r.tok.decode(ids.tolist())
    assert trained_text(r.tok, ids, mask) == [a + END[name] for a in ANSWERS]
    last = ChatRenderer(tokenizers[name], train_on="last-turn").render({"messages": CONVERSATION})
    assert trained_text(r.tok, *last) == [ANSWERS[-1] + END[name]]
    prompt = template_ids(r.tok, CONVERSATION[:4], add_generation_prompt=True)  # the history, tokenized whole
    assert last[0][:len(prompt)].tolist() == prompt and last[1][:len(prompt)].sum() == 0


def test_tool_calls_and_tool_turns_pass_through_the_template(tokenizers):
    r = ChatRenderer(tokenizers["qwen"])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    ids, mask = r.render({"messages": TOOL_CALL, "tools": tools})
    assert ids.tolist() == template_ids(r.tok, TOOL_CALL, tools=tools)
    call, answer = trained_text(r.tok, ids, mask)
    assert call == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert answer == "It is 18C.<|im_end|>"
    first = int(np.flatnonzero(mask)[0])
    assert "# Tools" in r.tok.decode(ids[:first].tolist())  # the tools list, in the system turn: not trained
    llama = ChatRenderer(tokenizers["llama3"])
    ids, mask = llama.render({"messages": TOOL_CALL})
    assert trained_text(llama.tok, ids, mask) == [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', "It is 18C.<|eot_id|>"]


def run_tool(capsys, *args) -> tuple[int, str, dict]:
    code = preprocess_data.main(list(args))
    out, err = capsys.readouterr()
    return code, err, json.loads(out.strip().splitlines()[-1]) if code == 0 else None


def errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


BAD = ['not json', '{"text": "no messages"}', '{"messages": [{"role": "user", "content": "a question only"}]}',
       '{"messages": [{"role": "wizard", "content": "abracadabra"}, {"role": "assistant", "content": "ok"}]}',
       json.dumps({"messages": [{"role": "user", "content": "word " * 150}, {"role": "assistant", "content": "x"}]})]


def test_bad_records_are_counted_or_refused_in_one_line(tokenizers, tmp_path, capsys):
    good = {"messages": CONVERSATION}
    src = write_records(tmp_path / "c.jsonl", [good, *BAD, good])
    prefix = str(tmp_path / "out" / "c")
    code, err, summary = run_tool(capsys, "--chat", "--input", src, "--tokenizer-model", tokenizers["llama3"],
                                  "--output-prefix", prefix, "--max-tokens", "120", "--workers", "2")
    assert code == 0, err
    assert summary["documents"] == 2 and summary["records"] == 7
    assert summary["left_out"] == {"not_json": 1, "no_messages": 1, "template_error": 1, "no_assistant": 1,
                                   "too_long": 1}
    said = [ln for ln in err.splitlines() if ln.startswith("left out")]
    assert len(said) == 1 and f"1 template_error (first {src}:5: the chat template rejects it (Unknown role: " \
        "wizard))" in said[0] and f"1 too_long (first {src}:6: " in said[0], err
    ids, mask = ChatRenderer(tokenizers["llama3"]).render(good)
    assert document_lengths(prefix).tolist() == document_lengths(loss_mask_prefix(prefix)).tolist() == [ids.size] * 2
    assert open_indexed(prefix).get(1).tolist() == ids.tolist()  # the last good record, in input order
    assert open_indexed(loss_mask_prefix(prefix)).get(1).tolist() == mask.tolist()
    assert summary["trained_tokens"] == 2 * int(mask.sum())
    # --strict: the first one is an error naming the record; nothing is written
    for n, (record, message) in enumerate(zip(BAD[1:4], ["no 'messages' field", "no assistant turn",
                                                         "the chat template rejects it (Unknown role: wizard)"])):
        src = write_records(tmp_path / f"bad{n}.jsonl", [good, record])
        code, err, _ = run_tool(capsys, "--chat", "--strict", "--input", src, "--tokenizer-model",
                                tokenizers["llama3"], "--output-prefix", str(tmp_path / f"strict{n}"))
        assert code == 2 and len(errors(err)) == 1 and errors(err)[0].startswith(f"error: {src}:2: {message}"), err
        assert not [f for f in os.listdir(tmp_path) if f.startswith(f"strict{n}")]


def test_a_tokenizer_without_chat_template_is_one_line(tmp_path, capsys):
    tok = llama3_chat_tokenizer(tmp_path / "tok", template=None)
    src = write_records(tmp_path / "c.jsonl", [{"messages": CONVERSATION}])
    code, err, _ = run_tool(capsys, "--chat", "--input", src, "--tokenizer-model", tok, "--output-prefix",
                            str(tmp_path / "c"))
    assert code == 2 and errors(err) == [f"error: the tokenizer {tok} has no chat template: pass --chat-template FILE "
                                         f"(a Jinja chat template), or use the tokenizer of a chat model"], err
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}")
    code, err, summary = run_tool(capsys, "--chat", "--input", src, "--tokenizer-model", tok, "--chat-template",
                                  str(tmp_path / "t.jinja"), "--output-prefix", str(tmp_path / "c"))
    assert code == 0 and summary["documents"] == 1 and "chat_template.jinja" in err, err


# ---- reading: the mask found by the prefix, in blends with text -------------------------------------------------
BOS, END_USER, EOT, ASSISTANT = 0, 2, 3, 4  # answers: ids 5-99 then EOT (trained); prompts: ids 100-249
DATA = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.make_vocab_size_divisible_by=64", "data.seq_length=48",
        "data.tokenizer_type=NullTokenizer", "data.vocab_size=255", "train.micro_batch_size=4",
        "train.global_batch_size=4", "train.train_iters=5", "train.device=cpu"]


def chat_corpus(prefix: str, n: int = 60, seed: int = 0) -> None:
    g = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        ids, mask = [BOS], [0]
        for _ in range(int(g.integers(1, 3))):
            prompt = g.integers(100, 250, int(g.integers(2, 15))).tolist() + [END_USER, ASSISTANT]
            answer = g.integers(5, 100, int(g.integers(1, 9))).tolist() + [EOT]
            ids, mask = ids + prompt + answer, mask + [0] * len(prompt) + [1] * len(answer)
        convs.append((ids, mask))
    write_conversations(prefix, convs)


def test_a_run_finds_the_mask_by_the_prefix_and_blends_it_with_text(tmp_path):
    """Each chat row's loss mask, positions and documents follow from its token values alone (a conversation starts
    at BOS; answers are ids below 100 and EOT): trained labels of conversations that start in the row; text rows
    keep their own rules (here: every token, no documents)."""
    chat_corpus(str(tmp_path / "chat"))
    write_indexed(str(tmp_path / "text"), [list(range(100, 100 + n)) for n in range(10, 70)])
    cfg = load_config(None, DATA + [f"data.data_path=[0.5, {tmp_path / 'chat'}, 0.5, {tmp_path / 'text'}]",
                                    f"data.data_cache_path={tmp_path / 'cache'}"])
    train = build_dataset(cfg, split_sizes(cfg, 4)).train
    batch = make_batch(train, list(range(12)), cfg.data)
    sources = [train.source(k) for k in range(12)]
    assert 3 <= sum(sources) <= 9
    for row, src in enumerate(sources):
        tokens, labels = batch["tokens"][row], batch["labels"][row]
        if src == 1:  # text
            assert batch["loss_mask"][row].eq(1).all() and batch["position_ids"][row].tolist() == list(range(48))
            continue
        is_bos = tokens == BOS
        begun = torch.cummax(is_bos.long(), 0).values.bool()
        trained = (labels < 100) & (labels >= 5) | (labels == EOT)
        assert batch["loss_mask"][row].tolist() == (trained & begun).float().tolist()
        last_bos = torch.cummax(torch.where(is_bos, torch.arange(48), torch.zeros(48, dtype=torch.long)), 0).values
        assert batch["position_ids"][row].tolist() == (torch.arange(48) - last_bos).tolist()
        starts = torch.nonzero(is_bos[1:]).flatten() + 1
        assert batch["documents"].cu[row] == (0, *starts.tolist(), 48)


def test_loss_mask_files_that_do_not_match_or_a_flash_kernel_are_one_line(tmp_path):
    chat_corpus(str(tmp_path / "chat"))
    base = DATA + [f"data.data_path={tmp_path / 'chat'}", f"data.data_cache_path={tmp_path / 'cache'}"]
    with pytest.raises(DataError, match=r"holds conversations .* with parallel.attention_backend=flash"):
        build_dataset(load_config(None, base + ["parallel.attention_backend=flash"]), [20, 0, 0])
    write_pairs([loss_mask_prefix(str(tmp_path / "chat"))], [np.uint8], [([1, 0],)] * 60)
    with pytest.raises(DataError) as e:
        build_dataset(load_config(None, base), [20, 0, 0])
    assert str(e.value).startswith(f"{tmp_path / 'chat'}.loss_mask does not match the tokens of {tmp_path / 'chat'} "
                                   f"(document 0 has ") and "\n" not in str(e.value)
    write_indexed(str(tmp_path / "chat"), [[5, 6, 7]] * 60)  # the prefix written again as text: its mask goes
    assert not os.path.exists(loss_mask_prefix(str(tmp_path / "chat")) + ".bin")
