"""``pretrain_gpt.py`` as one node's launcher (``--nproc-per-node``, ``--nnodes`` ...) whose ranks run a test hook:
each rank is ``tests/support/faults_driver.py HOOK ARGS`` instead of ``pretrain_gpt.py ARGS``; everything else --
the arguments, the config check, the rendezvous -- is ``pretrain_gpt.main``'s.

    python -m tests.support.node_driver HOOK pretrain_gpt.py [pretrain_gpt.py arguments...]

(the form of ``PYTHON pretrain_gpt.py ...`` in ``scripts/slurm/launch.sh``, with this module in place of python)
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.training import launcher  # noqa: E402

DRIVER = os.path.join(ROOT, "tests", "support", "faults_driver.py")


def main(hook: str, script: str, argv: list[str]) -> int:
    if os.path.basename(script) != "pretrain_gpt.py":
        raise SystemExit(f"node_driver runs pretrain_gpt.py, not {script}")
    original = launcher.launch_local

    def with_hook(nproc, _script, args, grace_s, saves=True, nodes=launcher.Nodes()):
        return original(nproc, DRIVER, [hook, *args], grace_s, saves, nodes)

    launcher.launch_local = with_hook
    import pretrain_gpt

    return pretrain_gpt.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
