"""Validation during training (Megatron's ``--eval-interval``, ``--eval-iters``): the loss and perplexity of the
valid split every ``train.eval_interval`` steps and once more after the last step; the test split once at the end
with ``train.test_at_end``.

What is evaluated: the first ``train.eval_iters`` global batches of the split (``data.split``: documents training
never reads), the same samples every time, so the numbers compare across steps, resumes and layouts. Each global
batch is read as training reads one (``batches.microbatches``: this dp rank's micro-batches, sharded for its cp
rank) and run forward under the training layout without autograd -- tp, ring / Ulysses / hybrid / FPDT cp, FSDP2,
MsT, Memo and recompute all run their plain forward. The loss is the mean over every valid token of those batches
-- training's loss mask: of conversations, the assistant turns only --: each rank sums its masked token losses and
counts its tokens, both summed over dp x cp (tp ranks hold the same full loss), so the value does not depend on the
layout -- it equals one process evaluating the same samples. Perplexity is ``exp(loss)``; batches without a valid
token give NaN for both (said once).

Example, ``eval_interval: 100``, ``eval_iters: 10``, ``train_iters: 250``, global batch 16: the first 160 samples of
the valid split are evaluated after steps 100, 200 and 250.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

import torch

from ...config import Config, Layout
from ...device import has_values
from ...parallel.collectives import all_reduce
from ...parallel.topology import Axis, Topology
from ..batches import microbatches

log = logging.getLogger("megatron_lc")


def evaluate_loss(model, dataset, cfg: Config, layout: Layout, topo: Topology, execution, iters: int) -> torch.Tensor:
    """[loss sum, valid tokens] over the first ``iters`` global batches of ``dataset``, summed over every rank's
    share (the same on every rank): a float64 tensor on the device, accumulated there and all-reduced once; no
    autograd, no value read."""
    sums = torch.zeros(2, dtype=torch.float64, device=execution.device)
    with torch.no_grad():
        for i in range(iters):
            for b in microbatches(cfg, layout, topo, dataset, i * layout.global_batch_size, execution.device):
                with execution.autocast():
                    token_loss = model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))
                sums[0] += (token_loss.float() * b["loss_mask"]).sum()
                sums[1] += b["loss_mask"].sum(dtype=torch.float64)
    all_reduce(sums, topo, Axis.DP_CP)
    return sums


class Validator:
    """Runs the valid / test evaluations of a run (``setup``: ``setup.TrainingSetup``) and returns their records:
    ``{"eval": "valid", "step": 100, "loss": 3.21, "perplexity": 24.8, "tokens": 40960, "samples": 160,
    "seconds": 1.9}``."""

    def __init__(self, setup):
        self.setup, self.cfg = setup, setup.cfg
        self.last_step: Optional[int] = None  # the step of the last valid evaluation

    def due(self, step: int) -> bool:
        """A valid evaluation after ``step`` (every ``train.eval_interval`` steps)."""
        n = self.cfg.train.eval_interval
        return bool(n) and step % n == 0

    def evaluate(self, split: str, step: int) -> dict:
        """Evaluate ``split`` ("valid" or "test") with the weights after ``step``; every rank calls this."""
        s = self.setup
        dataset = getattr(s.splits, split) if s.splits is not None else None
        if dataset is None:
            raise ValueError(f"the {split} split was not built for this run")
        t0 = time.perf_counter()
        was_training = s.model.training
        s.model.eval()
        try:
            sums = evaluate_loss(s.model, dataset, self.cfg, s.layout, s.topo, s.execution, self.cfg.train.eval_iters)
        finally:
            s.model.train(was_training)
        if split == "valid":
            self.last_step = step
        record = {"eval": split, "step": step, "loss": None, "perplexity": None, "tokens": None,
                  "samples": self.cfg.train.eval_iters * s.layout.global_batch_size}
        if has_values(sums):  # (a rehearsal's fake tensors have none: its record has no loss)
            loss_sum, tokens = sums.tolist()  # the evaluation's one device-to-host read
            if not tokens:
                log.warning("the %s split's first %d global batches have no trained token (their loss masks are all "
                            "zero): no %s loss", split, self.cfg.train.eval_iters, split)
            loss = loss_sum / tokens if tokens else math.nan
            perplexity = math.nan if not tokens else math.exp(loss) if loss < 700 else math.inf
            record.update(loss=loss, perplexity=perplexity, tokens=int(tokens))
        record["seconds"] = time.perf_counter() - t0
        return record

    def at_end(self, step: int) -> list[dict]:
        """The end of training: the valid split unless it was just evaluated, the test split on request."""
        out = []
        if self.cfg.train.eval_interval and self.last_step != step:
            out.append(self.evaluate("valid", step))
        if self.cfg.train.test_at_end:
            out.append(self.evaluate("test", step))
        return out
