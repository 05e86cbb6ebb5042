"""The errors that end a run in one line (``pretrain_gpt.py`` shows the message as is and exits 3): divergence,
a lost or stuck peer (``faults.py``), a failed or non-finite save (``checkpointing/save.py``)."""
from __future__ import annotations


class TrainingError(RuntimeError):
    """Training cannot go on; the message is one line meant to be shown as is (pretrain_gpt.py exits 3)."""

    per_rank = False  # True: each rank's message differs (shown by every rank, not only rank 0)


class NonFiniteError(TrainingError):
    pass


class CollectiveTimeoutError(TrainingError):
    per_rank = True


class PeerLostError(TrainingError):
    per_rank = True
