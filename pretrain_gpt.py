"""Pretrain a Llama/GPT model.

    python pretrain_gpt.py --nproc-per-node N --config X.yaml [--set k=v ...]    # N local ranks, config checked first
    python pretrain_gpt.py --nproc-per-node N --nnodes M --node-rank R --master-addr HOST ...   # one of M nodes
    torchrun --nproc-per-node N pretrain_gpt.py --config X.yaml [--set k=v ...]  # any launcher
    python pretrain_gpt.py --config X.yaml                                        # one process

With ``--nproc-per-node`` this script is the launcher (``training/launcher.py``): it checks the config and the
layout for N ranks before it starts anything (a mistake is one line, nothing spawned), forwards SIGTERM, SIGINT and
SIGUSR1 to the ranks, waits ``--shutdown-grace`` seconds for their checkpoint, and ends with their exit code.
With ``--nnodes M`` the same command runs on every node (``scripts/slurm/launch.sh``: one srun task per node): node
0 hosts the rendezvous store at ``--master-addr:--master-port``, the others join it.
An error is one line, said once: rank 0 says it; another rank says its own only when it differs from rank 0's
(agreed through the rendezvous store, ``training/entry.py``). Ctrl-C stops like SIGTERM (the step finishes, a
checkpoint is saved, exit 0); a second Ctrl-C stops at once without saving (exit 130).
Exit codes: 0 done or stopped with a checkpoint, 2 a config or data error, 3 training could not go on
(training/faults.py: non-finite steps, a failed save, a stuck or lost rank), 130 interrupted, 128 + N killed by
signal N.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="YAML config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value; repeatable, e.g. --set train.train_iters=5")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N local ranks after checking the config for them (training/launcher.py)")
    p.add_argument("--shutdown-grace", type=float, default=600.0, metavar="S",
                   help="with --nproc-per-node: seconds to wait for the ranks' checkpoint after a forwarded signal")
    p.add_argument("--nnodes", type=int, default=1, metavar="M",
                   help="with --nproc-per-node: the run's nodes, each running this command with its --node-rank")
    p.add_argument("--node-rank", type=int, default=0, metavar="R", help="with --nnodes: this node, 0..M-1")
    p.add_argument("--master-addr", default="127.0.0.1", metavar="HOST",
                   help="with --nnodes: node 0's host name or address; its launcher hosts the rendezvous store")
    p.add_argument("--master-port", type=int, default=None, metavar="P",
                   help="with --nnodes: the rendezvous store's port on node 0 (default 29500; one node: any free port)")
    return p.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the config for ``--nnodes`` x ``--nproc-per-node`` ranks, then run this node's
    (``training/launcher.py``)."""
    from megatron_lc.config import ConfigError, load_config, resolve_layout
    from megatron_lc.data import with_tokenizer_vocab
    from megatron_lc.training.launcher import DEFAULT_PORT, Nodes, launch_local, worker_args

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, not {args.nproc_per_node}")
    port = args.master_port if args.master_port is not None else DEFAULT_PORT if args.nnodes > 1 else 0
    nodes = Nodes(args.nnodes, args.node_rank, args.master_addr, port)
    cfg = with_tokenizer_vocab(load_config(args.config, args.overrides), warn=False)  # the ranks say it
    resolve_layout(cfg, args.nnodes * args.nproc_per_node)  # ConfigError or DataError: nothing spawned
    return launch_local(args.nproc_per_node, os.path.abspath(__file__), worker_args(argv), args.shutdown_grace,
                        nodes=nodes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from megatron_lc.config import ConfigError, load_config
    from megatron_lc.data import DataError, with_tokenizer_vocab
    from megatron_lc.training.errors import TrainingError, record_error
    from megatron_lc.training.faults import ignore_stop_signals, out_of_host_memory
    from megatron_lc.training.launcher import follow_launcher
    from megatron_lc.training.process_group import env_world, set_threads, setup_logging

    rank = env_world()[0]
    try:
        if args.nproc_per_node is not None:
            return launch(args, argv)
        if args.nnodes != 1 or args.node_rank or args.master_port is not None:
            raise ConfigError("--nnodes, --node-rank and --master-port go with --nproc-per-node (this command as "
                              "each node's launcher)")
        follow_launcher()
        setup_logging(rank)
        logging.getLogger("megatron_lc").info(set_threads())  # the log's first line: before any work
        # model.vocab_size unset: the tokenizer's
        cfg = with_tokenizer_vocab(load_config(args.config, args.overrides), warn=rank == 0)
        from megatron_lc.training.entry import run

        run(cfg)
        ignore_stop_signals(rank)  # and on to the process' end: the run has ended well
    except (ConfigError, DataError) as e:
        # said already by entry.run when the ranks could agree on it; before that (the config, the layout) every
        # rank fails the same way and rank 0 speaks for all
        if not getattr(e, "said", False) and rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        record_error(f"error: {e}")  # under torchrun: its summary's root cause
        return 2
    except TrainingError as e:  # divergence, a failed save, a stuck or lost rank (megatron_lc/training/faults.py)
        if rank == 0 or e.per_rank:
            print(f"error: {e}", file=sys.stderr)
        record_error(f"error: {e}")
        return 3
    except (MemoryError, RuntimeError) as e:  # a failed host allocation is one line per rank that had it
        message = out_of_host_memory(e)
        if message is None:
            raise
        print(f"error: {f'rank {rank}: ' if env_world()[1] > 1 else ''}{message}", file=sys.stderr)
        record_error(f"error: {message}")
        return 3
    except KeyboardInterrupt:  # Ctrl-C outside the training steps (during setup): nothing to save
        if rank == 0:
            print("error: interrupted (Ctrl-C) before training began: stopped without saving", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
