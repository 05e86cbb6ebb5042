"""The errors that end a run in one line (``pretrain_gpt.py`` shows the message as is and exits 3): divergence,
a lost or stuck peer (``faults.py``), a failed or non-finite save (``checkpointing/save.py``); ``record_error``: a
rank's error line where torchrun reads the root cause of a failed run."""
from __future__ import annotations

import contextlib
import json
import os
import time


class TrainingError(RuntimeError):
    """Training cannot go on; the message is one line meant to be shown as is (pretrain_gpt.py exits 3)."""

    per_rank = False  # True: each rank's message differs (shown by every rank, not only rank 0)


class NonFiniteError(TrainingError):
    pass


class CollectiveTimeoutError(TrainingError):
    per_rank = True


class PeerLostError(TrainingError):
    per_rank = True


def record_error(line: str) -> None:
    """Write this rank's one-line error (``error: ...``) to the error file torchrun's agent gave it
    (``TORCHELASTIC_ERROR_FILE``), in the format of ``torch.distributed.elastic``'s ``ErrorHandler``: torchrun's
    summary of the failed ranks then shows it as the root cause, where it said "To enable traceback see ..." for a
    rank that exited with a code. The line stands where the handler puts a traceback (``py_callstack``), which is
    what the summary prints. Nothing without torchrun (``--nproc-per-node`` and a lone process print the line and
    that is all)::

        Root Cause (first observed failure):
        [0]:
          ...
          exitcode  : 2 (pid: 12994)
          error_file: /tmp/torchelastic_.../attempt_0/0/error.json
          traceback : error: world size (3) must be divisible by tp (1) x cp (2) = 2
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump(data, f)
