"""`checkpoint:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .base import check


@dataclass
class CheckpointConfig:
    save: Optional[str] = None  # directory of checkpoints (iter_NNNNNNN/ inside)
    load: Optional[str] = None  # a save directory to resume from (its latest complete checkpoint)
    save_interval: Optional[int] = None  # steps; a final checkpoint is always written when save is set
    keep_last: Optional[int] = None  # keep only the newest N checkpoints
    # torch.distributed.checkpoint's async_save: the step waits only while the state is copied to host memory; the
    # write goes on in the background, at most one at a time (the next save and the end wait for it)
    async_save: bool = False
    load_fallback: bool = True  # a missing / corrupt file: resume from the newest older checkpoint that loads
    # the stages of a run (Megatron's names): weights only, or weights and a fresh iteration / data position / schedule
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False  # load the weights only; iteration, consumed samples and the LR schedule start at 0
    # a checkpoint is read as data (training/checkpointing/data_only.py); true also unpickles a file that holds more (an
    # older format's RNG file, or a planted one: only for a checkpoint you trust), said in the log
    trust_pickle: bool = False

    def __post_init__(self) -> None:
        check(self.save_interval is None or self.save_interval >= 1,
              f"checkpoint.save_interval ({self.save_interval}) must be >= 1")
        check(self.keep_last is None or self.keep_last >= 1, f"checkpoint.keep_last ({self.keep_last}) must be >= 1")
