"""The behaviour check of answer-only fine-tuning (tests/training/test_sft_behaviour.py, bench/sft_behaviour.py):
conversations whose answer is one fixed sentence after a random prompt, rendered by a Llama-3-style chat template
through ``tools/preprocess_data.py --chat``, trained twice from the same initialisation on the same tokens --
once with the loss on the answers (the written loss mask), once on every token (a mask of ones beside the same
tokens) -- and each model's loss on the answers measured afterwards."""
from __future__ import annotations

import contextlib
import io
import os

import numpy as np

from megatron_lc.config import load_config
from megatron_lc.data import build_dataset, split_sizes, with_tokenizer_vocab
from megatron_lc.data.chat import loss_mask_prefix, write_conversations
from megatron_lc.data.indexed import open_indexed
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.eval.validation import evaluate_loss
from megatron_lc.training.loop import Trainer
from tests.support.chat_util import fixed_answer_records, llama3_chat_tokenizer, write_records
from tools import preprocess_data

MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_query_groups=2",
         "model.ffn_hidden_size=192", "model.make_vocab_size_divisible_by=64", "train.device=cpu",
         "train.lr_warmup_iters=2", "train.min_lr=1e-4", "train.weight_decay=0.0", "logging.peak_tflops=1",
         "logging.log_interval=1000", "checkpoint.save=null"]


def make_corpora(directory: str, conversations: int, seed: int = 0) -> dict:
    """``{"tokenizer": dir, "answers": prefix, "every": prefix, "summary": the tool's JSON}``: the fixed-answer
    conversations preprocessed with the loss on the answers, and the same tokens with the loss on every token."""
    tok = llama3_chat_tokenizer(os.path.join(directory, "tokenizer"))
    src = write_records(os.path.join(directory, "chats.jsonl"), fixed_answer_records(conversations, seed))
    answers, every = os.path.join(directory, "answers"), os.path.join(directory, "every")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = preprocess_data.main(["--chat", "--input", src, "--tokenizer-model", tok, "--output-prefix", answers])
    assert code == 0, out.getvalue()
    tokens = open_indexed(answers)
    write_conversations(every, [(tokens.get(i), np.ones(int(n), np.uint8))
                                for i, n in enumerate(tokens.sequence_lengths)])
    assert os.path.exists(loss_mask_prefix(every) + ".bin")
    return {"tokenizer": tok, "answers": answers, "every": every, "summary": out.getvalue().strip()}


def config(corpora: dict, which: str, steps: int, overrides=()):
    """The run on ``corpora[which]`` ("answers" or "every"), ``model.vocab_size`` the tokenizer's."""
    prefix = corpora[which]
    return with_tokenizer_vocab(load_config(None, MODEL + [
        f"data.data_path={prefix}", "data.tokenizer_type=HuggingFaceTokenizer",
        f"data.tokenizer_model={corpora['tokenizer']}", "data.split=95,5,0",
        f"data.data_cache_path={os.path.dirname(prefix)}/cache", f"train.train_iters={steps}"] + list(overrides)),
        warn=False)


def train(corpora: dict, which: str, steps: int, overrides=()) -> tuple[list, Trainer]:
    """Train on ``corpora[which]``; returns the step losses and the trainer."""
    trainer = Trainer(config(corpora, which, steps, overrides), Topology())
    return trainer.train().losses, trainer


def answer_loss(corpora: dict, trainer: Trainer, overrides=(), batches: int = 4) -> float:
    """The loss on the answers only (the ``answers`` mask) of ``trainer``'s model (trained with ``overrides``) over
    the first ``batches`` global batches of the train split."""
    cfg = config(corpora, "answers", batches, overrides)
    data = build_dataset(cfg, split_sizes(cfg, trainer.layout.global_batch_size)).train
    sums = evaluate_loss(trainer.model, data, cfg, trainer.layout, trainer.topo, trainer.execution, batches)
    return float(sums[0] / sums[1])
