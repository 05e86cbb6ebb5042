"""``pretrain_gpt.py --nproc-per-node N`` with a test hook in every rank: the launcher (training/launcher.py) runs
``tests/support/faults_driver.py HOOK ARGS`` as its ranks instead of ``pretrain_gpt.py ARGS``.

    python -m tests.support.launch_driver N HOOK [pretrain_gpt.py arguments...]
"""
from __future__ import annotations

import os
import sys

from megatron_lc.training.launcher import launch_local

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

if __name__ == "__main__":
    driver = os.path.join(ROOT, "tests", "support", "faults_driver.py")
    sys.exit(launch_local(int(sys.argv[1]), driver, sys.argv[2:], 600.0))
