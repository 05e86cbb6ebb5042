"""``--nproc-per-node N`` for the command-line scripts (``pretrain_gpt.py``, ``tools/eval_long.py``): the script has
checked its config for N ranks; then torchrun's own launcher runs it N times in this process, and the exit code is
that of the first rank that failed -- whose one-line error that rank printed -- without the launcher's traceback."""
from __future__ import annotations

import logging
import os
import sys


def worker_args(argv: list[str]) -> list[str]:
    """Every argument but ``--nproc-per-node N`` / ``--nproc-per-node=N``.

    >>> worker_args(["--config", "x.yaml", "--nproc-per-node", "2", "--set", "a.b=1"])
    ['--config', 'x.yaml', '--set', 'a.b=1']
    """
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


def launch(script: str, argv: list[str], nproc: int) -> int:
    """Run ``script`` with ``argv`` (less ``--nproc-per-node``) on ``nproc`` local ranks (torchrun, standalone)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # torchrun's, only when launching
    from torch.distributed.run import get_args_parser, run

    logging.getLogger("torch.distributed").setLevel(logging.CRITICAL)  # the ranks report their own errors
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for N > 1, set here instead of its banner
    try:
        run(get_args_parser().parse_args(["--standalone", "--nproc-per-node", str(nproc), script,
                                          *worker_args(argv)]))
    except ChildFailedError as e:
        # the root cause: the first rank that exited by itself (the launcher then stops the others with SIGTERM)
        exited = [(f.timestamp, r, f.exitcode) for r, f in e.failures.items() if f.exitcode > 0]
        if exited:
            return min(exited)[2]
        rank, failure = min(e.failures.items())  # every failed rank was killed: it could not say anything itself
        print(f"error: rank {rank} was killed by signal {-failure.exitcode}", file=sys.stderr)
        return 1
    return 0
