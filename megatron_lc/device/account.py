"""``BufferAccount``: the framework's own accounting of the device buffers it creates (chunk buffers, rounding
buffers, arena views): benchmarks report its peak as "device-resident bytes by accounting". On CPU, host and device
are the same memory, so this accounting -- not RSS -- is the figure that stands for GPU memory."""
from __future__ import annotations

from collections import defaultdict

import torch


class BufferAccount:
    """Bytes of framework-created device buffers, by tag, with the running peak.

    ``acquire(tag, tensor)`` / ``release(tag, tensor)`` around a buffer's life; ``peak`` is the maximum of the sum
    over tags. ``reset_peak()`` starts a new measurement."""

    def __init__(self) -> None:
        self.live: dict = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.peak_by_tag: dict = defaultdict(int)

    @staticmethod
    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def acquire(self, tag: str, t_or_bytes) -> None:
        n = t_or_bytes if isinstance(t_or_bytes, int) else self.nbytes(t_or_bytes)
        self.live[tag] += n
        self.current += n
        self.peak = max(self.peak, self.current)
        self.peak_by_tag[tag] = max(self.peak_by_tag[tag], self.live[tag])

    def release(self, tag: str, t_or_bytes) -> None:
        n = t_or_bytes if isinstance(t_or_bytes, int) else self.nbytes(t_or_bytes)
        self.live[tag] -= n
        self.current -= n

    def reset_peak(self) -> None:
        self.peak = self.current
        self.peak_by_tag = defaultdict(int, self.live)

    def summary(self) -> dict:
        return {"current_bytes": self.current, "peak_bytes": self.peak, "peak_by_tag": dict(self.peak_by_tag)}
