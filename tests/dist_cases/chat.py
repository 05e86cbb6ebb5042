"""Rank functions for tests/training/test_chat_layouts.py: the first step of training on packed conversations (loss
masked to the answers) and a validation, under several layouts in one spawn, against the one-process run.

Two corpora of conversations (NullTokenizer ids; bos 0, user header 1, assistant header 4, end of turn 3):

* ``mixed``: 1 to 3 turns of a 3-20 token prompt and a 2-12 token answer, packed and cut across 64-token samples;
* ``prompt_tail``: every conversation exactly one sample long (64 tokens) with its only answer in tokens 6-12 and a
  50-token user turn after it, so every cp rank other than 0 holds prompt tokens only, in every layout (ring
  zigzag: rank 1 holds tokens 16-47; Ulysses: 32-63; FPDT, pieces of 16: 16-31 and 48-63)."""
from __future__ import annotations

import numpy as np
import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.data.chat import write_conversations
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from megatron_lc.training.optimizer import sync_gradients
from tests.dist_cases.fsdp import full_grad

BOS, USER, EOT, ASSISTANT = 0, 1, 3, 4
SEQ = 64
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
         "model.ffn_hidden_size=128", "model.make_vocab_size_divisible_by=64", f"data.seq_length={SEQ}",
         "data.tokenizer_type=NullTokenizer", "data.vocab_size=255", "data.split=90,10,0", "train.device=cpu",
         "train.global_batch_size=4", "train.train_iters=1", "train.clip_grad=0", "train.eval_iters=1",
         "logging.peak_tflops=1", "checkpoint.save=null"]


def mixed_corpus(prefix: str, n: int = 160, seed: int = 0) -> None:
    g = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        ids, mask = [BOS], [0]
        for _ in range(int(g.integers(1, 4))):
            prompt = [USER] + g.integers(100, 250, int(g.integers(3, 21))).tolist() + [EOT, ASSISTANT]
            answer = g.integers(5, 100, int(g.integers(2, 13))).tolist() + [EOT]
            ids += prompt + answer
            mask += [0] * len(prompt) + [1] * len(answer)
        convs.append((ids, mask))
    write_conversations(prefix, convs)


def prompt_tail_corpus(prefix: str, n: int = 60, seed: int = 1) -> None:
    g = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        head = [BOS, USER] + g.integers(100, 250, 3).tolist() + [ASSISTANT]  # tokens 0-5
        answer = g.integers(5, 100, 6).tolist() + [EOT]  # tokens 6-12: the only trained ones
        tail = [USER] + g.integers(100, 250, SEQ - 14).tolist()  # tokens 13-63
        convs.append((head + answer + tail, [0] * 6 + [1] * 7 + [0] * (SEQ - 13)))
    write_conversations(prefix, convs)


def first_step(rank: int, world: int, data_path: str, cache: str, overrides: list, validate: bool = True) -> dict:
    """Loss, full gradients (rank 0) and validation loss of the first step, and this rank's trained tokens."""
    cfg = load_config(None, MODEL + [f"data.data_path={data_path}", f"data.data_cache_path={cache}"]
                      + (["train.eval_interval=1"] if validate else []) + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses) if world > 1 else Topology()
    t = Trainer(cfg, topo, layout=layout)
    t.optimizer.zero_grad(set_to_none=True)
    batches = t.microbatches(0)
    local = float(sum(b["loss_mask"].sum() for b in batches))
    loss = float(t.forward_backward(batches))
    sync_gradients(t.model, topo)
    grads = {n: full_grad(p, topo) for n, p in t.model.named_parameters()}
    finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
    valid = t.validator.evaluate("valid", 0)["loss"] if validate else None
    return {"loss": loss, "valid": valid, "grads": grads if rank == 0 else None, "finite": finite,
            "local_tokens": local, "cp_rank": topo.cp_rank, "tokens": float(t.counts[0])}


def cases(rank: int, world: int, data: dict, cache: str, spec: dict) -> dict:
    """``first_step`` of every case ``{name: (corpus, overrides, validate)}`` (one spawn for all)."""
    torch.set_num_threads(1)
    return {name: first_step(rank, world, data[corpus], cache, ov, validate)
            for name, (corpus, ov, validate) in spec.items()}
