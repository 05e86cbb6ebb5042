"""``pretrain_gpt.py --nproc-per-node N`` with a test hook in every rank: the launcher (training/launcher.py) runs
``tests/faults_driver.py HOOK ARGS`` as its ranks instead of ``pretrain_gpt.py ARGS``.

    python -m tests.launch_driver N HOOK [pretrain_gpt.py arguments...]
"""
from __future__ import annotations

import os
import sys

from megatron_lc.training.launcher import launch_local

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    sys.exit(launch_local(int(sys.argv[1]), os.path.join(ROOT, "tests", "faults_driver.py"), sys.argv[2:], 600.0))
