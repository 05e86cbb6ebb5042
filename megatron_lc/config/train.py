"""`train:` section: optimisation and schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from .base import check

FLOAT32_MAX = 3.4028234663852886e38


@dataclass
class TrainConfig:
    train_iters: int = 10
    micro_batch_size: int = 1
    global_batch_size: Optional[int] = None  # default: micro_batch_size * dp
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: Literal["cosine", "linear", "constant"] = "cosine"
    lr_decay_iters: Optional[int] = None  # default: train_iters
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # 0 disables clipping
    seed: int = 1234
    bf16: bool = False  # GPU: bf16 autocast with fp32 master weights
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # ---- validation (training/eval/validation.py; Megatron's names) ----
    # steps between validations of the valid split (data.split), and once more after the last step; unset: none
    eval_interval: Optional[int] = None
    eval_iters: int = 10  # global batches of the valid split per validation: the same samples every time
    test_at_end: bool = False  # after training, the test split's first eval_iters global batches, once
    # ---- faults (training/faults.py) ----
    exit_signal_handler: bool = True  # SIGTERM/SIGUSR1 -> all ranks save a checkpoint after the step and exit 0
    exit_duration_in_mins: Optional[float] = None  # same, once this much wall time has passed since start
    max_consecutive_skipped_steps: int = 5  # non-finite loss/grad norm: skip the step; stop after this many in a row

    def __post_init__(self) -> None:
        check(self.train_iters >= 0, f"train.train_iters ({self.train_iters}) must be >= 0")
        check(self.micro_batch_size >= 1, f"train.micro_batch_size ({self.micro_batch_size}) must be >= 1")
        check(self.max_consecutive_skipped_steps >= 1,
              f"train.max_consecutive_skipped_steps ({self.max_consecutive_skipped_steps}) must be >= 1")
        check(self.exit_duration_in_mins is None or self.exit_duration_in_mins > 0,
              f"train.exit_duration_in_mins ({self.exit_duration_in_mins}) must be > 0")
        check(self.eval_interval is None or self.eval_interval >= 1,
              f"train.eval_interval ({self.eval_interval}) must be >= 1 (unset: no validation)")
        check(self.eval_iters >= 1, f"train.eval_iters ({self.eval_iters}) must be >= 1")
        for name in ("lr", "min_lr", "weight_decay", "clip_grad"):  # finite in the fp32 the optimizer computes in
            value = getattr(self, name)
            check(0 <= value <= FLOAT32_MAX, f"train.{name} ({value}) must be a finite number >= 0")
        check(self.adam_eps > 0 and math.isfinite(self.adam_eps), f"train.adam_eps ({self.adam_eps}) must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            check(0 <= value < 1, f"train.{name} ({value}) must be in [0, 1)")
        check(self.global_batch_size is None or self.global_batch_size >= 1,
              f"train.global_batch_size ({self.global_batch_size}) must be >= 1")
        check(self.lr_warmup_iters >= 0, f"train.lr_warmup_iters ({self.lr_warmup_iters}) must be >= 0")
        check(self.lr_decay_iters is None or self.lr_decay_iters >= 1,
              f"train.lr_decay_iters ({self.lr_decay_iters}) must be >= 1")
