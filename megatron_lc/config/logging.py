"""`logging:` section."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from .base import check


@dataclass
class LoggingConfig:
    log_interval: int = 1
    metrics_file: Optional[str] = None  # default: <checkpoint.save>/metrics.jsonl, else ./metrics.jsonl
    wandb_project: Optional[str] = None  # wandb is used only when a project is set
    wandb_mode: Literal["offline", "online"] = "offline"
    wandb_dir: Optional[str] = None
    peak_tflops: float = 989.0  # per device, for MFU (H100 bf16 dense); CPU configs set their own

    def __post_init__(self) -> None:
        check(self.log_interval >= 1, f"logging.log_interval ({self.log_interval}) must be >= 1")
