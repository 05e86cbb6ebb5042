"""`train:` section: optimisation and schedule."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check


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

    def __post_init__(self) -> None:
        check(self.train_iters >= 0, f"train.train_iters ({self.train_iters}) must be >= 0")
        check(self.micro_batch_size >= 1, f"train.micro_batch_size ({self.micro_batch_size}) must be >= 1")
        check(self.lr >= 0 and self.min_lr >= 0, f"train.lr ({self.lr}) and train.min_lr ({self.min_lr}) must be >= 0")
