"""Pretrain a Llama/GPT model.

    python pretrain_gpt.py --nproc-per-node N --config X.yaml [--set k=v ...]    # N local ranks, config checked first
    torchrun --nproc-per-node N pretrain_gpt.py --config X.yaml [--set k=v ...]  # any launcher (SLURM: scripts/slurm)
    python pretrain_gpt.py --config X.yaml                                        # one process

With ``--nproc-per-node`` this script is the launcher: it checks the config and the layout for N ranks before it
starts anything (a mistake is one line, nothing spawned), then runs torchrun's own launcher in this process and ends
with the exit code of the first rank that failed -- whose one-line error the rank printed -- without the launcher's
traceback. Under a bare ``torchrun``, rank 0 prints the error line and torchrun adds its own failure report.
Exit codes: 0 done, 2 a config or data error, 3 training could not go on (training/faults.py).
"""
from __future__ import annotations

import argparse
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable, e.g. --set train.train_iters=5")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N local ranks after checking the config for them (torchrun's launcher)")
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the config for ``--nproc-per-node`` ranks, then run them with torchrun's launcher (standalone)."""
    from megatron_lc.config import load_config, resolve_layout
    from megatron_lc.data import with_tokenizer_vocab
    from megatron_lc.training.launcher import launch as launch_ranks

    cfg = with_tokenizer_vocab(load_config(args.config, args.overrides), warn=False)  # the ranks say it
    resolve_layout(cfg, args.nproc_per_node)  # ConfigError or DataError: nothing spawned
    return launch_ranks(__file__, argv, args.nproc_per_node)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.data import DataError, with_tokenizer_vocab
    from megatron_lc.training.faults import TrainingError
    from megatron_lc.training.runtime import env_world, setup_logging

    rank = env_world()[0]
    try:
        if args.nproc_per_node is not None:
            return launch(args, argv)
        setup_logging(rank)
        # model.vocab_size unset: the tokenizer's
        cfg = with_tokenizer_vocab(load_config(args.config, args.overrides), warn=rank == 0)
        from megatron_lc.training.entry import run

        run(cfg)
    except (ConfigError, DataError) as e:
        if rank != 0:
            # the same config and files on every rank: rank 0 fails the same way, exits first and speaks for all (the
            # launcher stops this rank meanwhile); a rank still alive after the wait failed alone and says why
            time.sleep(2.0)
        print(f"{'' if rank == 0 else f'[rank {rank}] '}error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as e:  # divergence, a stuck or lost rank (megatron_lc/training/faults.py)
        if rank == 0 or e.per_rank:
            print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
