"""The behaviour check of answer-only fine-tuning, cheap (a longer run with the figures: bench/sft_behaviour.py):
conversations whose answer is one fixed sentence after a random prompt (tests/support/sft_behaviour.py). Trained on
the answers, the loss falls near zero within a few dozen steps; trained on every token of the same conversations,
it cannot: the random prompts keep it up (their words are drawn uniformly from 20)."""
from __future__ import annotations

import torch

from tests.support.sft_behaviour import answer_loss, make_corpora, train

STEPS = 40
RUN = ["data.seq_length=256", "train.micro_batch_size=4", "train.global_batch_size=4", "train.lr=1e-2"]


def test_answer_only_loss_falls_near_zero_where_every_token_cannot(tmp_path):
    torch.set_num_threads(1)
    corpora = make_corpora(str(tmp_path), 200)
    answers, answers_run = train(corpora, "answers", STEPS, RUN)
    every, every_run = train(corpora, "every", STEPS, RUN)
    assert answers[0] > 5 and every[0] > 5  # the same random start (a 600-id vocabulary: ln 600 = 6.4)
    # measured (this machine, 1 thread), the last step: answers 0.075, every token 0.96; each model's loss on the
    # answers afterwards: 0.075 and 0.40 (every token spends the same steps on the prompts too)
    assert max(answers[-3:]) < 0.15, answers
    assert min(every[-3:]) > 0.5, every
    on_answers = answer_loss(corpora, answers_run, RUN), answer_loss(corpora, every_run, RUN)
    assert on_answers[0] < 0.15 and on_answers[1] > 2 * on_answers[0], on_answers
