"""`logging:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check


@dataclass
class LoggingConfig:
    log_interval: int = 1
    metrics_file: Optional[str] = None  # default: <checkpoint.save>/metrics.jsonl, else none (console only)
    wandb_project: Optional[str] = None  # wandb is used only when a project is set
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_dir: Optional[str] = None
    # per device, for MFU; unset: the median of short GEMMs in the training dtype timed before the first step,
    # said in the log with their spread (set it for an MFU that other jobs on the machine do not move)
    peak_tflops: Optional[float] = None

    def __post_init__(self) -> None:
        check(self.log_interval >= 1, f"logging.log_interval ({self.log_interval}) must be >= 1")
        check(self.peak_tflops is None or self.peak_tflops > 0,
              f"logging.peak_tflops ({self.peak_tflops}) must be > 0 (or unset: measured)")
