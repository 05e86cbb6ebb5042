"""Pretrain a Llama/GPT model: ``torchrun --nproc-per-node N pretrain_gpt.py --config X.yaml [--set k=v ...]``."""
from __future__ import annotations

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable, e.g. --set train.train_iters=5")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.data import DataError
    from megatron_lc.training.faults import TrainingError
    from megatron_lc.training.runtime import env_world, setup_logging

    rank = env_world()[0]
    setup_logging(rank)
    try:
        cfg = load_config(args.config, args.overrides)
        from megatron_lc.training.entry import run

        run(cfg)
    except (ConfigError, DataError) as e:
        # every rank prints: under torchrun the launcher stops the others as soon as one exits
        print(f"{'' if rank == 0 else f'[rank {rank}] '}error: {e}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as e:  # divergence, a stuck or lost rank (megatron_lc/training/faults.py)
        if rank == 0 or e.per_rank:
            print(f"error: {e}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
