"""Run ``pretrain_gpt.main`` in a subprocess with a test-only fault injected by monkeypatching (test code only;
the library has no fault-injection switch).

    python -m tests.support.faults_driver HOOK [pretrain_gpt.py arguments...]
    python -m tests.support.faults_driver HOOK eval_long [tools/eval_long.py arguments...]

Hooks:
    none                   plain run
    hang_in_save:N:MARKER  the save of iteration N writes its first file, touches MARKER, then sleeps (to be killed)
    hang_at_step:N:RANK    rank RANK sleeps for 10 minutes before step N (a rank that never joins a collective)
    marker_after_step:N:MARKER   touch MARKER once step N is done (to send a signal mid-run)
    signal_before_step:N:MARKER  before step N every rank waits until it has received a stop signal (SIGTERM,
                                 SIGUSR1, SIGINT); rank 0 touches MARKER when it begins to wait: the run stops after
                                 step N exactly, wherever the signal was sent from
    signal_after_step:N:MARKER   the same once step N is done: the stop is seen by no step's agreement (N the last
                                 step: a signal to a run that has finished training)
    signal_after_training:MARKER every rank, once training has returned and stop signals are ignored
                                 (``entry.run``), touches MARKER.<rank> and waits until a stop signal reaches it
    rank1_fails_first:MARKER     rank 1 touches MARKER when it is about to say its error; rank 0 builds its
                                 dataset only after that (an order of failures that timing rarely gives)
    eval_rank1_fails_first:MARKER   the same for tools/eval_long.py: rank 0 checks the passkey arguments only
                                 after rank 1 is about to say its error
"""
from __future__ import annotations

import os
import signal
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _touch(path: str) -> None:
    with open(path, "w") as f:
        f.write(str(os.getpid()))


def _rank1_first(marker: str, module, name: str) -> None:
    """Rank 1 touches ``marker`` when it is about to say its error; rank 0 runs ``module.name`` only after that."""
    from megatron_lc.training import entry

    rank = int(os.environ.get("RANK", 0))
    if rank == 1:
        original_say = entry.say_once

        def say_once(*a):
            _touch(marker)
            original_say(*a)

        entry.say_once = say_once
    elif rank == 0:
        original = getattr(module, name)

        def after_rank1(*a):
            while not os.path.exists(marker):
                time.sleep(0.05)
            return original(*a)

        setattr(module, name, after_rank1)


def install(hook: str) -> None:
    kind, *args = hook.split(":")
    if kind == "none":
        return
    if kind == "hang_in_save":
        from megatron_lc.training.checkpointing import save as checkpoint

        iteration, marker = int(args[0]), args[1]
        original = checkpoint.atomic_torch_save

        def slow_save(obj, path):
            original(obj, path)
            if f"iter_{iteration:07d}.tmp" in path:
                _touch(marker)
                time.sleep(600)

        checkpoint.atomic_torch_save = slow_save
    elif kind in ("hang_at_step", "marker_after_step", "signal_before_step", "signal_after_step"):
        from megatron_lc.training.loop import Trainer

        n = int(args[0])
        original_step = Trainer.train_step

        def wait_for_signal(self):
            if self.topo.rank == 0:
                _touch(args[1])
            while not self.stop.received:  # set by the trainer's own handler
                time.sleep(0.05)

        def patched(self, step):
            if kind == "hang_at_step" and step + 1 == n and self.topo.rank == int(args[1]):
                time.sleep(600)
            if kind == "signal_before_step" and step + 1 == n:
                wait_for_signal(self)
            rec = original_step(self, step)
            if kind == "marker_after_step" and step + 1 == n and self.topo.rank == 0:
                _touch(args[1])
            if kind == "signal_after_step" and step + 1 == n:
                wait_for_signal(self)
            return rec

        Trainer.train_step = patched
    elif kind == "signal_after_training":
        from megatron_lc.training import entry

        original_ignore = entry.ignore_stop_signals

        def ignore_then_wait(rank):
            previous = original_ignore(rank)
            got = []
            for s in previous:
                handler = signal.getsignal(s)
                if callable(handler):  # the handler that ignores, and a note that it ran
                    signal.signal(s, lambda signum, frame, h=handler: (h(signum, frame), got.append(signum)))
            _touch(f"{args[0]}.{rank}")
            while not got:
                time.sleep(0.05)
            return previous

        entry.ignore_stop_signals = ignore_then_wait
    elif kind == "rank1_fails_first":
        from megatron_lc.training import setup

        _rank1_first(args[0], setup, "build_dataset")
    elif kind == "eval_rank1_fails_first":
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import eval_long

        _rank1_first(args[0], eval_long, "check_passkey")
    else:
        raise SystemExit(f"unknown hook {hook}")


def main() -> int:
    install(sys.argv[1])
    if sys.argv[2:3] == ["eval_long"]:
        sys.path.insert(0, os.path.join(ROOT, "tools"))
        import eval_long

        return eval_long.main(sys.argv[3:])
    import pretrain_gpt

    return pretrain_gpt.main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
