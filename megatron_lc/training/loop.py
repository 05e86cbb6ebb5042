"""The pretraining loop: build, (resume), then per step: micro-batches -> forward/backward -> grad sync -> clip ->
AdamW -> metrics -> checkpoint.

Loss normalisation: every step's loss is the mean over all valid tokens of the global batch. Each rank divides its
token-loss sum by the *global* valid-token count (all-reduced over dp x cp before the micro-batches), so summing
gradients over dp x cp gives exactly the gradient of the global mean whatever the layout -- the cp split cannot bias
the average (Megatron once averaged per-rank means instead)."""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..config import Config
from ..data import build_dataset, make_batch, microbatch_sample_ids
from ..parallel.collectives import all_reduce
from ..parallel.layout import shard_batch
from ..parallel.parallelize import build_model
from ..parallel.topology import Axis, Topology
from .checkpoint import load_checkpoint, save_checkpoint
from .faults import SkipCounter, StopControl, collective_errors
from .logger import MetricsLogger
from .metrics import peak_memory_bytes, step_metrics
from .optimizer import build_optimizer, clip_grad_norm, lr_at, set_lr, sync_gradients

log = logging.getLogger("megatron_lc")


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    losses: list = field(default_factory=list)  # per-step global loss, for tests and callers
    skipped_steps: int = 0  # non-finite steps skipped in this run
    stop_reason: Optional[str] = None  # set when a signal or the time limit stopped the run early


class Trainer:
    def __init__(self, cfg: Config, topo: Topology, device: Optional[torch.device] = None):
        self.cfg, self.topo = cfg, topo
        self.device = device or torch.device("cpu")
        self.dp = cfg.check_layout(topo.world_size)
        self.stop = StopControl(cfg)
        self.skips = SkipCounter(cfg)
        self.dataset = build_dataset(cfg)  # data files are checked before the (possibly long) model build
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, topo, self.device)
        self.optimizer = build_optimizer(self.model, cfg, topo)
        self.state = TrainState()
        meta = load_checkpoint(cfg, topo, self.model, self.optimizer)
        if meta is not None:
            self.state.iteration = meta["iteration"]
            self.state.consumed_samples = meta["consumed_samples"]
            log.info("resumed from %s at iteration %d", meta["path"], meta["iteration"])
        self.metrics = MetricsLogger(cfg, topo.rank)

    # ---- one step ------------------------------------------------------------------------------------------
    def microbatches(self, consumed: int) -> list[dict]:
        """This rank's micro-batches of the step that starts after ``consumed`` global samples.

        The step's samples are ``[consumed, consumed + gbs)`` whatever the step number, so a run resumed with
        another global batch size (or dp) still reads every sample exactly once."""
        t = self.cfg.train
        n_micro = t.global_batch_size // (t.micro_batch_size * self.dp)
        out = []
        for m in range(n_micro):
            ids = [consumed + i for i in microbatch_sample_ids(0, m, t.global_batch_size, t.micro_batch_size,
                                                               self.dp, self.topo.dp_rank)]
            batch = shard_batch(make_batch(self.dataset, ids), self.cfg, self.topo)
            out.append({k: v.to(self.device) for k, v in batch.items()})
        return out

    def autocast(self):
        if self.cfg.train.bf16 and self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def forward_backward(self, batches: list[dict]) -> float:
        """Accumulate gradients of the global-mean loss over the micro-batches; returns the global loss."""
        count = torch.tensor(sum(float(b["loss_mask"].sum()) for b in batches), dtype=torch.float64)
        all_reduce(count, self.topo, Axis.DP_CP)
        total = max(float(count), 1.0)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for b in batches:
            with self.autocast():
                token_loss = self.model(b["tokens"], b["position_ids"], b["labels"])
            local = (token_loss.float() * b["loss_mask"]).sum()
            (local / total).backward()
            loss_sum += local.detach().double().cpu()
        all_reduce(loss_sum, self.topo, Axis.DP_CP)
        return float(loss_sum) / total

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.forward_backward(self.microbatches(self.state.consumed_samples))
        sync_gradients(self.model, self.topo)
        grad_norm = clip_grad_norm(self.model, self.cfg.train.clip_grad, self.topo)
        lr = lr_at(step, self.cfg)
        # one small all-reduce per step: every rank skips and stops after the same steps
        signum, time_up, skipped = self.stop.agree(not (math.isfinite(loss) and math.isfinite(grad_norm)))
        if not skipped:
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = time.perf_counter() - t0
        rec = {"step": step + 1, "train_iters": self.cfg.train.train_iters, "loss": loss, "lr": lr,
               "grad_norm": grad_norm, "skipped": skipped, "step_seconds": dt,
               "consumed_samples": self.state.consumed_samples + self.cfg.train.global_batch_size,
               "peak_memory_bytes": peak_memory_bytes(self.device)}
        rec.update(step_metrics(self.cfg, self.topo.world_size, dt))
        rec["stop"] = StopControl.reason(signum, time_up)
        return rec

    # ---- the loop ------------------------------------------------------------------------------------------
    def save(self) -> None:
        if self.cfg.checkpoint.save:
            path = save_checkpoint(self.cfg, self.topo, self.model, self.optimizer, self.state.iteration,
                                   self.state.consumed_samples)
            log.info("saved checkpoint %s", path)

    def train(self) -> TrainState:
        c = self.cfg
        last_saved = self.state.iteration
        self.stop.install()
        # --- memory.plan (issue 7): profile + plan before step 1 (auto) or load a plan; installs the arena ---
        from ..memory.planning import prepare_memory_plan

        self.arena = prepare_memory_plan(self)
        # -----------------------------------------------------------------------------------------------------
        try:
            while self.state.iteration < c.train.train_iters:
                step = self.state.iteration + 1
                with collective_errors(c, self.topo.rank, f"step {step}"):
                    rec = self.train_step(self.state.iteration)
                self.state.iteration += 1
                self.state.consumed_samples = rec["consumed_samples"]
                self.state.losses.append(rec["loss"])
                self.metrics.log_step(rec)
                self.skips.update(step, rec["skipped"], rec["loss"], rec["grad_norm"])
                self.state.skipped_steps = self.skips.total
                if rec["stop"]:
                    self.state.stop_reason = rec["stop"]
                    log.warning("%s: stopping after step %d%s", rec["stop"], step,
                                ", saving a checkpoint" if c.checkpoint.save else " (no checkpoint.save set)")
                    break
                if c.checkpoint.save_interval and self.state.iteration % c.checkpoint.save_interval == 0:
                    with collective_errors(c, self.topo.rank, f"the checkpoint save of step {step}"):
                        self.save()
                    last_saved = self.state.iteration
            if c.checkpoint.save and last_saved != self.state.iteration:
                with collective_errors(c, self.topo.rank, f"the checkpoint save of step {self.state.iteration}"):
                    self.save()
        finally:
            self.stop.uninstall()
            self.metrics.close()
        return self.state
