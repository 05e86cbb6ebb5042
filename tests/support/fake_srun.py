"""``srun`` for tests, on one machine: the command once per node, each "node" a process with the variables srun sets
for a task of a one-task-per-node step, and SIGTERM / SIGINT / SIGUSR1 forwarded to every task, as srun does.

    fake_srun.py --nodes N --ntasks-per-node 1 [--kill-on-bad-exit=1] [--chdir D] [--output PATTERN]
                 [--open-mode append|truncate] COMMAND...

``--output``: ``%n`` the node id, ``%t`` the task id, ``%j`` the job id (each task's stdout and stderr there).
``--kill-on-bad-exit=1``: a task that exits non-zero has the others killed (SIGKILL). Prints each task's exit as
``srun: task T (node N) exited with C`` and exits with the highest code (a task killed by signal S counts 128 + S).
Any other option is refused, so a script that starts using one is noticed.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="srun")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--ntasks-per-node", type=int, default=1, choices=[1])
    p.add_argument("--kill-on-bad-exit", type=int, default=0)
    p.add_argument("--chdir", default=None)
    p.add_argument("--output", default=None)
    p.add_argument("--open-mode", default="truncate", choices=["append", "truncate"])
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if not args.command or args.command[0].startswith("-"):
        p.error(f"unknown option or no command: {args.command[:1]}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    job = os.environ.get("SLURM_JOB_ID", "0")
    tasks: list[subprocess.Popen] = []

    def forward(signum, frame):
        for t in tasks:
            if t.poll() is None:
                t.send_signal(signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(s, forward)
    for node in range(args.nodes):
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
                   SLURM_NNODES=str(args.nodes), SLURM_NTASKS=str(args.nodes), SLURM_STEP_NUM_NODES=str(args.nodes),
                   SLURM_STEP_NUM_TASKS=str(args.nodes), SLURM_STEP_ID="0")
        out = None
        if args.output:
            path = args.output.replace("%n", str(node)).replace("%t", str(node)).replace("%j", job)
            out = open(path, "a" if args.open_mode == "append" else "w")
        tasks.append(subprocess.Popen(args.command, cwd=args.chdir, env=env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None))
        if out:
            out.close()
    codes: dict[int, int] = {}
    while len(codes) < len(tasks):
        for i, t in enumerate(tasks):
            if i not in codes and t.poll() is not None:
                codes[i] = t.returncode if t.returncode >= 0 else 128 - t.returncode
                print(f"srun: task {i} (node {i}) exited with {codes[i]}", flush=True)
                if codes[i] != 0 and args.kill_on_bad_exit:
                    for other in tasks:
                        if other.poll() is None:
                            other.kill()
        time.sleep(0.05)
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
