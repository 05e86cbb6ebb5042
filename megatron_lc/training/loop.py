"""The pretraining loop: per step, micro-batches -> forward/backward -> grad sync -> clip -> AdamW -> metrics ->
checkpoint. What it runs is built by ``setup.setup_training`` (layout, data, model, memory, optimizer, resume).

Loss normalisation: every step's loss is the mean over all valid tokens of the global batch (the loss mask's: every
token of text, less end-of-document inputs with ``data.eod_mask_loss``; the assistant turns of conversations). Each
rank divides its token-loss sum by the *global* valid-token count (all-reduced over dp x cp before the
micro-batches), so summing gradients over dp x cp gives exactly the gradient of the global mean whatever the layout
-- the cp split cannot bias the average (Megatron once averaged per-rank means instead), and a rank or micro-batch
without a valid token adds exactly zero (never 0 / 0, Megatron-LM's NaN on a cp rank holding only prompt tokens).
A global batch without any valid token has no mean: its loss is NaN, its gradients zero, and the step is skipped and
counted as a non-finite one is (``faults.SkipCounter``)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Config, Layout
from ..parallel.collectives import all_reduce
from ..parallel.topology import Axis, Topology
from .checkpointing.async_save import AsyncCheckpointer
from .checkpointing.save import save_checkpoint
from .faults import SkipCounter, StopControl, collective_errors
from .batches import microbatches
from .checkpointing.directory import iter_dir
from .logger import MetricsLogger, StepBar, format_summary, process_seconds
from .metrics import pairs_per_sample, peak_flops, peak_memory_bytes, step_counts, step_metrics
from .optimizer import clip_grad_norm, lr_at, set_lr, sync_gradients
from .setup import setup_training
from .eval.validation import Validator

log = logging.getLogger("megatron_lc")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: list = field(default_factory=list)  # per-step global loss, for tests and callers
    skipped_steps: int = 0  # non-finite steps skipped since the run began (resumes included)
    stop_reason: Optional[str] = None  # set when a signal or the time limit stopped the run early


class Trainer:
    """``Trainer(cfg, topo, device)`` sets the run up (``setup.setup_training``, every step in order) and trains it."""

    def __init__(self, cfg: Config, topo: Topology, device: Optional[torch.device] = None,
                 layout: Optional[Layout] = None, adjust_spec=None, execution=None, stage=lambda name: None):
        self.setup = setup_training(cfg, topo, device, layout, adjust_spec, execution, stage)
        s = self.setup
        self.cfg, self.layout, self.topo, self.execution = cfg, s.layout, topo, s.execution
        self.device = s.execution.device
        self.model, self.ctx, self.optimizer, self.arena = s.model, s.ctx, s.optimizer, s.arena
        self.stop = StopControl(cfg)
        self.skips = SkipCounter(cfg, s.resumed)
        self.state = TrainState()
        if s.resumed is not None:
            self.state.iteration = s.resumed["iteration"]
            self.state.consumed_samples = s.resumed["consumed_samples"]
        self.metrics = MetricsLogger(cfg, topo.rank, s.resumed)
        self.validator = Validator(s)  # train.eval_interval / eval_iters / test_at_end
        self.async_checkpoints = AsyncCheckpointer(cfg, topo) if cfg.checkpoint.async_save else None
        self.peak: Optional[float] = None  # MFU's baseline, found before the first step (``baseline``)
        self.peak_source = ""
        self.mfu_valid = True
        self.pairs: Optional[float] = None
        self.counts: Optional[torch.Tensor] = None
        self.moe_aux_loss: Optional[torch.Tensor] = None  # the last step's, the mean over its micro-batches (MoE)
        # off in a rehearsal (fake tensors have no values): the step then reads none -- no loss, no grad norm, no
        # skip / stop agreement, no MFU sanity check
        self.reads_values = True

    def baseline(self) -> float:
        """The peak FLOP/s per rank MFU is relative to (``metrics.peak_flops``: set, or short GEMMs timed for half a
        second), found once, before the first step -- a run with nothing to do times nothing -- and said."""
        if self.peak is None:
            self.peak, self.peak_source = peak_flops(self.cfg, self.execution)
            log.info("MFU is relative to %.3g TFLOP/s per rank (%s)", self.peak / 1e12, self.peak_source)
        return self.peak

    def microbatches(self, consumed: int) -> list[dict]:
        """This rank's micro-batches of the step after ``consumed`` global samples (``batches.py``)."""
        return microbatches(self.cfg, self.layout, self.topo, self.setup.dataset, consumed, self.device)

    def forward_backward(self, batches: list[dict]) -> torch.Tensor:
        """Accumulate gradients of the global-mean loss over the micro-batches; returns the global loss (a 0-dim
        fp64 tensor on the device: nothing here reads a value; NaN when the global batch has no valid token). Sets
        ``self.counts``: the all-reduced ``metrics.step_counts`` (the global valid-token count, MFU's attended
        pairs)."""
        counts = step_counts(batches, self.layout)  # one all-reduce: the global valid-token count and MFU's attended pairs
        all_reduce(counts, self.topo, Axis.DP_CP)
        self.counts = counts
        total = counts[0].clamp(min=1.0).float()  # (fp32: the same division as by a Python number)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        balance = []  # an MoE model's load-balancing loss of each micro-batch (its gradient is the routers' own)
        for b in batches:
            with self.execution.autocast():
                token_loss = self.model(b["tokens"], b["position_ids"], b["labels"], b.get("documents"))
            local = (token_loss.float() * b["loss_mask"]).sum()
            (local / total).backward()
            loss_sum = loss_sum + local.detach().double()
            if self.ctx.routing.aux_loss() is not None:
                balance.append(self.ctx.routing.aux_loss())
        self.moe_aux_loss = torch.stack(balance).mean() if balance else None
        all_reduce(loss_sum, self.topo, Axis.DP_CP)
        return loss_sum / counts[0]  # 0 / 0 = NaN without a valid token: the step is skipped

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(self.microbatches(self.state.consumed_samples))
        sync_gradients(self.model, self.topo)
        grad_norm = clip_grad_norm(self.model, self.cfg.train.clip_grad, self.topo)
        lr = lr_at(step, self.cfg)
        signum, time_up, skipped = 0, False, False
        tokens, balance = None, []
        if self.reads_values:  # the step's one device-to-host read (a rehearsal runs without values)
            moe = [self.moe_aux_loss] if self.moe_aux_loss is not None else []
            read = [torch.as_tensor(v, dtype=torch.float64, device=self.counts.device)
                    for v in (loss, grad_norm, self.counts[0], *moe)]
            loss, grad_norm, tokens, *balance = torch.stack(read).tolist()
            tokens = int(tokens)
            self.pairs = pairs_per_sample(self.counts, self.layout)
            # one small all-reduce per step: every rank skips and stops after the same steps
            signum, time_up, skipped = self.stop.agree(not (math.isfinite(loss) and math.isfinite(grad_norm)))
        else:
            loss = grad_norm = None
        if not skipped:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "train_iters": self.cfg.train.train_iters, "loss": loss, "lr": lr,
               "grad_norm": grad_norm, "skipped": skipped, "tokens": tokens, "step_seconds": dt,
               "consumed_samples": self.state.consumed_samples + self.layout.global_batch_size,
               "peak_memory_bytes": peak_memory_bytes(self.device)}
        if balance:  # an MoE model's: Hugging Face's load-balancing loss, before its coefficient
            rec["moe_aux_loss"] = balance[0]
        rec.update(step_metrics(self.cfg, self.layout, dt, self.baseline(), self.pairs))
        if self.reads_values and rec["mfu"] > 1.0 and self.mfu_valid:  # the peak is wrong for this machine
            self.mfu_valid = False  # every rank stops reporting MFU; rank 0, whose records are logged, says so once
            if self.topo.rank == 0:
                log.warning(self.mfu_notice(rec["mfu"]))
        if not self.mfu_valid:
            rec["mfu"] = None
        rec["stop"] = StopControl.reason(signum, time_up)
        return rec

    def mfu_notice(self, mfu: float) -> str:
        """Why an MFU above 100% is left out, and the advice for where the peak came from: a peak the user set is
        raised or unset; a measured one (GEMMs timed before the first step, low when other work had the
        cores then) is replaced by the machine's own figure."""
        head = (f"MFU came out at {100 * mfu:.0f}% of the peak ({self.peak / 1e12:.3g} TFLOP/s, {self.peak_source}): "
                f"that peak is too low for this machine; MFU is left out of the metrics")
        if self.cfg.logging.peak_tflops is not None:
            return f"{head} (raise logging.peak_tflops to this machine's peak, or unset it to measure one)"
        return (f"{head} (the GEMMs timed before the first step ran slower than this step's work, as when other jobs "
                f"share the cores: set logging.peak_tflops to this machine's peak)")

    # ---- the loop ------------------------------------------------------------------------------------------
    def save(self) -> None:
        if self.cfg.checkpoint.save and self.async_checkpoints is not None:  # written in the background
            self.async_checkpoints.save(self.model, self.optimizer, self.state.iteration, self.state.consumed_samples,
                                        self.skips.meta())
        elif self.cfg.checkpoint.save:
            path = save_checkpoint(self.cfg, self.topo, self.model, self.optimizer, self.state.iteration,
                                   self.state.consumed_samples, self.skips.meta())
            log.info("saved checkpoint %s", path)

    def train(self) -> TrainState:
        c = self.cfg
        last_saved = self.state.iteration
        if self.state.iteration >= c.train.train_iters:
            log.info("nothing to do: the checkpoint is at iteration %d and train.train_iters is %d (raise "
                     "train.train_iters to train on)", self.state.iteration, c.train.train_iters)
            self.metrics.close()
            return self.state
        self.baseline()
        self.stop.install()
        first, losses_before = self.state.iteration + 1, len(self.state.losses)
        started = time.monotonic()
        bar = StepBar(self.topo.rank, c.train.train_iters, self.state.iteration)
        try:
            while self.state.iteration < c.train.train_iters:
                step = self.state.iteration + 1
                with collective_errors(c, self.topo.rank, f"step {step}"):
                    rec = self.train_step(self.state.iteration)
                self.state.iteration += 1
                self.state.consumed_samples = rec["consumed_samples"]
                self.state.losses.append(rec["loss"])
                self.metrics.log_step(rec)
                bar.update(rec)
                self.skips.update(step, rec["skipped"], rec["loss"], rec["grad_norm"], rec["tokens"])
                self.state.skipped_steps = self.skips.total
                if self.validator.due(step):
                    with collective_errors(c, self.topo.rank, f"the validation after step {step}"):
                        self.metrics.log_eval(self.validator.evaluate("valid", step))
                if rec["stop"]:
                    self.state.stop_reason = rec["stop"]
                    log.warning("%s: stopping after step %d%s", rec["stop"], step,
                                ", saving a checkpoint" if c.checkpoint.save else " (no checkpoint.save set)")
                    break
                if c.checkpoint.save_interval and self.state.iteration % c.checkpoint.save_interval == 0:
                    with collective_errors(c, self.topo.rank, f"the checkpoint save of step {step}"):
                        self.save()
                    last_saved = self.state.iteration
            if self.state.stop_reason is None:  # a stopped run exits promptly
                with collective_errors(c, self.topo.rank, "the validation at the end"):
                    for record in self.validator.at_end(self.state.iteration):
                        self.metrics.log_eval(record)
            if c.checkpoint.save and last_saved != self.state.iteration:
                with collective_errors(c, self.topo.rank, f"the checkpoint save of step {self.state.iteration}"):
                    self.save()
            if self.async_checkpoints is not None:  # the exit waits for the save in flight
                with collective_errors(c, self.topo.rank, "the last checkpoint save"):
                    self.async_checkpoints.wait()
        except BaseException:
            if self.async_checkpoints is not None:
                self.async_checkpoints.abandon()
            raise
        finally:
            bar.close()
            self.stop.uninstall()
            self.metrics.close()
        log.info(format_summary(first, self.state.losses[losses_before:], c.train.train_iters,
                                time.monotonic() - started, process_seconds(), self.state.stop_reason,
                                iter_dir(c.checkpoint.save, self.state.iteration) if c.checkpoint.save else None,
                                self.metrics.path))
        return self.state
