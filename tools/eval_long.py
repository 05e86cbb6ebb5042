"""Long-context evaluation of a checkpoint: loss by position bucket on held-out samples and passkey retrieval accuracy
by length x depth, under the config's parallel layout (tp, ring / Ulysses / hybrid / FPDT cp, dp).

    python tools/eval_long.py --config configs/tiny_cpu.yaml --load runs/tiny_cpu --out eval.json --png eval.png
    torchrun --nproc-per-node 8 tools/eval_long.py --config configs/llama3_8b_extend/stage3_1m.yaml \\
        --load runs/llama3_8b_extend/stage3_1m --out eval_1m.json --lengths 65536 262144 1048576 --depths 0 0.5 1

* Held-out samples (``--documents N``, sequences of ``data.seq_length`` tokens): the first N samples of the valid
  split of the config's data (``data.split``: documents training never reads), or of a separate ``--data-path``
  prefix (.bin/.idx, tokenized like the training data; all of it is the held-out split). Their per-token losses are
  averaged by position bucket (``--bucket-edges``, default 0, 1K, 4K, 16K, ... cut at the sequence length).
* Passkey (``--lengths``, ``--depths``, ``--trials`` keys of ``--key-digits`` digits per cell): a filler prompt with
  the key at the depth, then the question; a key counts when the model's argmax at every answer token is the key's
  token. Prompts are continued with filler to ``data.seq_length`` (the shape of the layout); lengths above it are
  refused. Token ids without a tokenizer, English text with the config's SentencePiece model.
* Prints a short summary (the mean loss of each position bucket, passkey keys right per length) and writes the full
  results as JSON to ``--out`` (every bucket's token count, every cell's accuracy and token accuracy, the layout,
  the times; without ``--out`` nothing is written and the summary says so) and, with ``--png``, a figure (needs
  matplotlib, the ``plot`` extra).

The weights are loaded at any layout (``load_checkpoint`` with no optimizer); nothing is saved (``checkpoint.save``
is ignored). Exit status: 0 done, 2 a config, data or checkpoint error (one line).
Library: ``megatron_lc/training/eval/by_position.py`` and ``passkey.py``; fields of the JSON:
``docs/context_extension.md``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from megatron_lc.config import Config, ConfigError, Layout, load_config, resolve_execution, resolve_layout  # noqa
from megatron_lc.data import DataError, build_dataset, build_tokenizer, with_tokenizer_vocab  # noqa: E402
from megatron_lc.parallel.topology import Topology  # noqa: E402
from megatron_lc.training.checkpointing.load import load_checkpoint  # noqa: E402
from megatron_lc.training.checkpointing.directory import find_latest, is_hf_model_dir  # noqa: E402
from megatron_lc.training.entry import errors_said_once  # noqa: E402
from megatron_lc.training.launcher import follow_launcher, launch_local, worker_args  # noqa: E402
from megatron_lc.training.eval.by_position import bucket_edges, default_bucket_edges, evaluate_positions  # noqa: E402
from megatron_lc.training.eval.passkey import PasskeyPrompt, check_passkey, evaluate_passkey  # noqa: E402
from megatron_lc.training.process_group import (env_world, init_distributed, set_threads, setup_logging,  # noqa: E402
                                                shutdown)
from megatron_lc.training.setup import build_and_calibrate  # noqa: E402

log = logging.getLogger("megatron_lc")
DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
GRACE_S = 60.0  # --nproc-per-node: how long a forwarded Ctrl-C may take to end the ranks (nothing is saved)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the model's training config (YAML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable), e.g. a layout: --set parallel.context_parallel_size=8")
    p.add_argument("--load", default=None, help="checkpoint directory (a save dir: its newest checkpoint; or one "
                   "iter_N); default: the config's checkpoint.load")
    p.add_argument("--out", default=None, help="write the full results here as JSON (the terminal gets a summary)")
    p.add_argument("--png", default=None, help="figure: loss by position bucket, passkey accuracy grid")
    p.add_argument("--documents", type=int, default=8, help="held-out samples for the position loss (0: none)")
    p.add_argument("--data-path", default=None, help="held-out .bin/.idx prefix (default: the end of the config's "
                   "data)")
    p.add_argument("--bucket-edges", type=int, nargs="+", default=None, metavar="N",
                   help="position bucket edges from 0 (default 0 1024 4096 ... cut at data.seq_length)")
    p.add_argument("--lengths", type=int, nargs="*", default=None, metavar="L",
                   help="passkey prompt lengths (default: 1024 4096 16384 ... data.seq_length; none: no passkey)")
    p.add_argument("--depths", type=float, nargs="+", default=DEPTHS, metavar="D",
                   help="passkey depths, fractions of the filler before the key")
    p.add_argument("--trials", type=int, default=1, help="keys per (length, depth)")
    p.add_argument("--key-digits", type=int, default=5)
    p.add_argument("--seed", type=int, default=None, help="of the keys (default: train.seed)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="start N local ranks after checking the config for them (training/launcher.py), as "
                        "pretrain_gpt.py does")
    return p.parse_args(argv)


def eval_overrides(args: argparse.Namespace) -> list[str]:
    """The user's overrides, then what evaluation needs: the checkpoint to load, no saving, the weights' own
    iteration (``finetune`` would report 0), no global batch (any dp divides it), and the held-out file."""
    out = list(args.overrides)
    if args.load is not None:
        out.append(f"checkpoint.load={args.load}")
    out += ["checkpoint.save=", "checkpoint.finetune=false", "train.global_batch_size="]
    if args.data_path is not None:
        out += [f"data.data_path={args.data_path}", "data.mock_data=false", "data.prepare_demo_data=false",
                "data.split=0,1,0"]  # the whole file is the held-out (valid) split
    return out


def passkey_prompt(cfg: Config) -> PasskeyPrompt:
    """English text through the run's tokenizer (SentencePiece or Hugging Face, or the demo's); token ids for mock
    data without a tokenizer and for NullTokenizer."""
    d = cfg.data
    tokenizer_model = d.files(cfg.model.vocab_size)[1]
    if d.tokenizer_type == "NullTokenizer" or tokenizer_model is None:
        return PasskeyPrompt.token_ids(cfg.model.vocab_size)
    return PasskeyPrompt.from_tokenizer(build_tokenizer(d, cfg.model.vocab_size), tokenizer_model)


def layout_summary(layout: Layout) -> dict:
    return {"world_size": layout.world_size, "dp": layout.dp, "tp": layout.tp, "cp": layout.cp,
            "cp_comm_type": layout.cp_comm_type, "ulysses": layout.ulysses,
            "sequence_parallel": layout.sequence_parallel}


def check_args(args: argparse.Namespace, cfg: Config) -> None:
    """The arguments' mistakes, before any layout arithmetic or process group: the checkpoint first."""
    load = cfg.checkpoint.load
    if load is None:
        raise ConfigError("no checkpoint to evaluate: pass --load CKPT_DIR (or set checkpoint.load)")
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such directory")
    if is_hf_model_dir(load):
        raise ConfigError(f"--load {load} is a Hugging Face model directory; import it first: python "
                          f"tools/convert_from_hf.py {load} OUT_DIR")
    if find_latest(load) is None:
        raise ConfigError(f"--load {load} holds no megatron_lc checkpoint (no iter_*/meta.json)")
    if args.documents < 0 or args.trials < 1 or args.key_digits < 1:
        raise ConfigError(f"--documents ({args.documents}) must be >= 0, --trials ({args.trials}) and --key-digits "
                          f"({args.key_digits}) >= 1")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--png needs matplotlib, which is not installed (pip install 'megatron_lc[plot]')")


def evaluate(cfg: Config, args: argparse.Namespace) -> dict:
    """Every rank runs this; returns the results (the same on every rank)."""
    layout, topo, device = init_distributed(cfg)
    try:
        with errors_said_once(cfg, topo.rank):  # an error every rank meets is said by rank 0 alone
            return _evaluate(cfg, args, layout, topo, device)
    finally:
        shutdown()


def _evaluate(cfg: Config, args: argparse.Namespace, layout: Layout, topo: Topology, device: torch.device) -> dict:
    s = cfg.data.seq_length
    edges = bucket_edges(s, args.bucket_edges)
    lengths = default_bucket_edges(s)[1:] if args.lengths is None else args.lengths  # 1K, 4K, ... seq_length
    seed = cfg.train.seed if args.seed is None else args.seed
    # everything that can be wrong with the input, before the (possibly long) model build
    dataset = build_dataset(cfg, [0, args.documents, 0]).valid if args.documents else None
    prompt = passkey_prompt(cfg) if lengths else None
    if prompt is not None:
        check_passkey(prompt, lengths, args.depths, args.trials, args.key_digits, seed, s)
    torch.manual_seed(cfg.train.seed)
    execution = resolve_execution(cfg, device)
    model, _ = build_and_calibrate(cfg, layout, topo, execution)
    newest = find_latest(cfg.checkpoint.load)
    meta = load_checkpoint(cfg, topo, model, None)  # the weights only, resharded to this layout's tp
    if os.path.abspath(meta["path"]) != os.path.abspath(newest):  # checkpoint.load_fallback took an older one
        raise ConfigError(f"the newest checkpoint {newest} does not load, and eval_long evaluates only the newest: "
                          f"pass --load {meta['path']} to evaluate that older one")
    model.eval()
    log.info("evaluating %s (iteration %d) at tp=%d cp=%d (%s) dp=%d, %d tokens per sample", meta["path"],
             meta["iteration"], layout.tp, layout.cp, layout.cp_comm_type, layout.dp, s)
    out = {"checkpoint": meta["path"], "iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"],
           "config": args.config, "overrides": args.overrides, "layout": layout_summary(layout), "seq_length": s}
    seconds = {}
    with execution.autocast():
        if dataset is not None:
            t0 = time.perf_counter()
            ids = list(range(args.documents))  # the valid split's first samples: never trained on
            loss = evaluate_positions(model, dataset, ids, cfg.data, layout, topo, device, edges)
            source = (args.data_path if args.data_path is not None else "mock data" if cfg.data.mock_data else
                      f"the valid split (data.split {cfg.data.split}) of {cfg.data.files(cfg.model.vocab_size)[0]}")
            out["position_loss"] = {"source": source, "samples": len(ids), "sample_ids": ids,
                                    "seen_in_training": False, **loss.summary()}
            seconds["position_loss"] = time.perf_counter() - t0
        if prompt is not None:
            t0 = time.perf_counter()
            pk = evaluate_passkey(model, prompt, lengths, args.depths, args.trials, args.key_digits, seed, s,
                                  cfg.model.vocab_size, layout, topo, device)
            out["passkey"] = {"prompt": prompt.source, "key_digits": args.key_digits, "trials": args.trials,
                              "seed": seed, "lengths": lengths, "depths": args.depths, **pk}
            seconds["passkey"] = time.perf_counter() - t0
    return {**out, "seconds": seconds}


def tokens_label(n: int) -> str:
    """Short token count: 4096 -> ``'4K'``, 1048576 -> ``'1M'``, 1000 -> ``'1000'``."""
    for unit, size in (("M", 2**20), ("K", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def plot(results: dict, path: str) -> None:
    """Loss by position bucket (left) and the passkey accuracy grid, length x depth (right)."""
    # matplotlib is an optional dependency (the plot extra): imported only when a figure is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    pl = results.get("position_loss")
    if pl:
        buckets = [b for b in pl["buckets"] if b["mean_loss"] is not None]
        names = [f"{tokens_label(b['start'])}-{tokens_label(b['end'])}" for b in buckets]
        left.bar(names, [b["mean_loss"] for b in buckets])
        left.set_xlabel("position in the sequence (tokens)")
        left.set_ylabel("mean loss")
        left.set_title(f"loss by position, {pl['samples']} held-out samples")
    else:
        left.set_axis_off()
    pk = results.get("passkey")
    if pk:
        acc = pk["accuracy"]
        im = right.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        right.set_xticks(range(len(pk["depths"])), [f"{d:g}" for d in pk["depths"]])
        right.set_yticks(range(len(pk["lengths"])), [tokens_label(n) for n in pk["lengths"]])
        for i, row in enumerate(acc):
            for j, a in enumerate(row):
                right.text(j, i, f"{a:.2f}", ha="center", va="center", fontsize=8)
        right.set_xlabel("depth of the key")
        right.set_ylabel("prompt length (tokens)")
        right.set_title(f"passkey accuracy, {pk['trials']} key(s) per cell")
        fig.colorbar(im, ax=right)
    else:
        right.set_axis_off()
    fig.suptitle(f"{results['checkpoint']} (iteration {results['iteration']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(results: dict) -> list[str]:
    """What the terminal gets: the checkpoint and layout, the mean loss of each position bucket, the passkey keys
    right per length (over its depths and trials). Example (the demo's checkpoint, the data's name shortened)::

        evaluated runs/tiny_cpu/iter_0000100 (iteration 100): 256 tokens per sample, tp 1 cp 1 (p2p) dp 1
        loss by position (4 held-out samples, the valid split (data.split 969,30,1) of data/demo/...): mean 5.107
          0-64         5.088 (256 tokens)
          64-128       4.972 (256 tokens)
          128-256      5.184 (512 tokens)
        passkey, keys right (5 depths x 1 key(s) per length):
          128          0 of 5 (0%)
          256          0 of 5 (0%)
    """
    lay = results["layout"]
    out = [f"evaluated {results['checkpoint']} (iteration {results['iteration']}): {results['seq_length']} tokens per "
           f"sample, tp {lay['tp']} cp {lay['cp']} ({lay['cp_comm_type']}) dp {lay['dp']}"]
    pl = results.get("position_loss")
    if pl:
        mean = "n/a" if pl["mean_loss"] is None else f"{pl['mean_loss']:.3f}"
        out.append(f"loss by position ({pl['samples']} held-out samples, {pl['source']}): mean {mean}")
        for b in pl["buckets"]:
            name = f"{tokens_label(b['start'])}-{tokens_label(b['end'])}"
            loss = "n/a" if b["mean_loss"] is None else f"{b['mean_loss']:.3f}"
            out.append(f"  {name:<12} {loss} ({b['tokens']:,} tokens)")
    pk = results.get("passkey")
    if pk:
        per = len(pk["depths"]) * pk["trials"]
        out.append(f"passkey, keys right ({len(pk['depths'])} depths x {pk['trials']} key(s) per length):")
        for length, row in zip(pk["lengths"], pk["accuracy"]):
            right = round(sum(row) * pk["trials"])
            out.append(f"  {tokens_label(length):<12} {right} of {per} ({100 * right / per:.0f}%)")
    return out


def write(results: dict, out: str | None, png: str | None) -> None:
    for path in (out, png):
        if path and os.path.dirname(os.path.abspath(path)):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    if png:
        plot(results, png)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    rank = env_world()[0]
    follow_launcher()  # a rank of --nproc-per-node: ended with its launcher
    setup_logging(rank)
    try:
        cfg = with_tokenizer_vocab(load_config(args.config, eval_overrides(args)), warn=False)
        check_args(args, cfg)
        if args.nproc_per_node is not None:
            resolve_layout(cfg, args.nproc_per_node)  # a layout mistake: one line, nothing spawned
            return launch_local(args.nproc_per_node, os.path.abspath(__file__), worker_args(argv), GRACE_S,
                                saves=False)
        log.info(set_threads())
        results = evaluate(cfg, args)
    except (ConfigError, DataError) as e:
        # said already when the ranks could agree on it (evaluate); before the process group every rank fails the
        # same way and rank 0 speaks for all (as pretrain_gpt.py)
        if not getattr(e, "said", False) and rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (forwarded to every rank by the launcher): nothing to keep
        if rank == 0:
            print("error: interrupted (Ctrl-C): stopped without results", file=sys.stderr, flush=True)
        return 130
    if rank == 0:
        try:
            write(results, args.out, args.png)
        except OSError as e:
            print(f"error: cannot write the results: {e}", file=sys.stderr)
            return 2
        print("\n".join(summary_lines(results)))
        written = [p for p in (args.out, args.png) if p]
        if written:
            print(f"wrote {' and '.join(written)}{' (the full results)' if args.out else ''}", flush=True)
        if not args.out:
            print("the full results (every bucket's tokens, every passkey cell, token accuracies) were not written: "
                  "add --out FILE.json", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
