"""Byte counters for collectives (see ``collectives.py`` for what "bytes sent" means per op)."""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Optional

import torch


class CommStats:
    """Bytes sent, keyed by (tag, op). ``tag`` is set by the caller (e.g. the layer name). Point-to-point transfers
    also count what they receive (``received``): in a sparse exchange the two differ by rank. Beside the traffic,
    ``pairs``: the (query, key) pairs the core attention of each tag ran for each head in its forward calls -- the
    compute a layout balances. A forward re-run inside the backward (host checkpoints, full recompute, segments)
    counts its pairs in ``rerun_pairs`` and its forward receipts under ``<op>.rerun``, so a layer's figures are
    one forward's whatever the memory technique (its sent bytes stay in ``bytes``, re-runs included)."""

    def __init__(self) -> None:
        self.bytes: dict = defaultdict(int)
        self.calls: dict = defaultdict(int)
        self.received: dict = defaultdict(int)
        self.pairs: dict = defaultdict(int)
        self.rerun_pairs: dict = defaultdict(int)
        self._tag = "untagged"

    @contextlib.contextmanager
    def tag(self, name: str):
        prev, self._tag = self._tag, name
        try:
            yield
        finally:
            self._tag = prev

    def add(self, op: str, nbytes: float) -> None:
        self.bytes[(self._tag, op)] += int(nbytes)
        self.calls[(self._tag, op)] += 1

    def add_received(self, op: str, nbytes: float) -> None:
        rerun = op.endswith("_fwd") and in_backward()
        self.received[(self._tag, op + ".rerun" if rerun else op)] += int(nbytes)

    def add_pairs(self, n: int) -> None:
        (self.rerun_pairs if in_backward() else self.pairs)[self._tag] += int(n)

    def total(self, tag: Optional[str] = None, op: Optional[str] = None) -> int:
        return sum(v for (t, o), v in self.bytes.items() if (tag is None or t == tag) and (op is None or o == op))

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.received.clear()
        self.pairs.clear()
        self.rerun_pairs.clear()


def in_backward() -> bool:
    """Inside the autograd engine: a forward run there is a re-run of a layer whose forward already ran (host
    checkpoints, recompute, MsT's chunks), which counters of a forward leave out (here; ``model/moe_loss.py``)."""
    return torch._C._current_graph_task_id() != -1
