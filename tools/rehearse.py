r"""Rehearse the training step at full scale on this CPU, before renting GPUs (docs/rehearsal.md).

    .venv/bin/python tools/rehearse.py --config configs/llama3_8b_1m.yaml --jobs 2        # all 8 ranks, 2 steps
    .venv/bin/python tools/rehearse.py --config configs/llama3_8b_1m.yaml --ranks 0,7 --out r.json --plot r.png
    .venv/bin/python tools/rehearse.py --config X.yaml --nproc-per-node 8 --nnodes 4 --ranks 0,9,31 \
        --set data.seq_length=16777216

How long: minutes to an hour a rank, each in a process of its own (under 1 GB), ``--jobs`` of them at once. On 2
shared cores: Llama3-8B at 1M, all 8 ranks with the job, ``--jobs 2``: about 12 min; Llama3-8B at 8M, one rank, the
steps alone: 16-66 min; Llama-3.1-70B at 6M on 32, one rank, the steps alone: about 70 min (docs/rehearsal.md).
``--ranks`` (the first and the last rank of a layout are the usual pair), ``--steps-only`` and ``--steps 1`` shorten
it; every phase's line says the seconds since its rank started.

Each simulated rank runs in its own process: the real setup and steps of ``pretrain_gpt.py`` under fake tensors and
a fake process group (``megatron_lc/rehearsal``); nothing of size is allocated. Prints each phase of each rank as it
starts (``rank 0: setup runtimes (at 14 s)``, ``rank 0: step 0 backward (at 31 s)``: setup's stages, each step's
forward, backward and optimizer step, seconds since the rank's process started), each rank's peak and its moment,
then, as its last line, exactly (one line, wrapped here)::

    rehearsal: R ranks, max peak device X.XX GiB (estimator Y.YY GiB allocated, +Z.Z%; F.FF GiB with its
    fragmentation reserve), max host H.HH GiB, V violations; ran: 2 steps, validation, save, async save, resume,
    resumed step

(the steps' peak beside the estimator's peak of live tensors, what the rehearsal counts, and beside it
``tools/estimate.py``'s peak, which adds the reserve; with ``--steps 1``, the estimator's first step instead:
``megatron_lc/rehearsal/report.py``). After the steps each rank runs the rest of a job (``rehearsal/job.py``): a
validation pass, a checkpoint save, an async save, a resume from it and the step after it, its checkpoint in a
temporary directory (the tensors' bytes counted, not written); a line per phase before the last gives its device
and host peak; ``--steps-only`` skips them. The accelerator is a stand-in device of its own, not the host
(``rehearsal/standin.py``): an op that mixes host and device tensors stops the rank there, named with its site.

Exit status: 0 when every rank's peak (the job's phases included) fits the hardware profile's usable memory and
nothing was violated, 1 when not, 2 for bad input. Figures are rehearsed: a trace of the framework's own tensors,
not of the caching allocator or the kernels' speed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_lc.config.cli import add_config_arguments  # noqa: E402  (after the path)
from megatron_lc.rehearsal.rank import PROGRESS  # noqa: E402
from tools.estimate import profiles  # noqa: E402

_SAY = threading.Lock()  # the ranks' threads and the main thread print whole lines


def say(line: str) -> None:
    with _SAY:
        print(line, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(p)
    p.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node (default: the profile's GPUs)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--ranks", default="all", help="ranks to rehearse: all (the default), or a list like 0,7")
    p.add_argument("--steps", type=int, default=2, help="training steps per rank, each to its optimizer step "
                   "(default 2: the second is the first with AdamW's states)")
    p.add_argument("--steps-only", action="store_true", help="the steps alone: no validation, save, async save, "
                   "resume and step after it")
    p.add_argument("--hardware", default="h100", help=f"a profile of configs/hardware/ ({', '.join(profiles())}): "
                   f"usable memory, host memory, GPUs per node (default h100)")
    p.add_argument("--jobs", type=int, default=1, help="ranks rehearsed at once, each a process (default 1)")
    p.add_argument("--out", default=None, help="write the JSON (every rank's figures, the summary) here")
    p.add_argument("--plot", default=None, help="write a PNG of device bytes over the step (matplotlib)")
    return p.parse_args(argv)


def rank_list(spec: str, world: int) -> list:
    from megatron_lc.config import ConfigError

    if spec == "all":
        return list(range(world))
    try:
        ranks = sorted({int(r) for r in spec.split(",") if r.strip()})
    except ValueError:
        raise ConfigError(f"--ranks ({spec!r}) must be 'all' or a comma-separated list of ranks") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if not ranks or bad:
        raise ConfigError(f"--ranks ({spec!r}): ranks must be in [0, {world}) for {world} ranks")
    return ranks


def run_rank(args, rank: int, world: int, nproc: int, host_gb: float, out: str) -> tuple[int, dict, str]:
    cmd = [sys.executable, "-m", "megatron_lc.rehearsal.rank", "--config", args.config, "--rank", str(rank),
           "--world", str(world), "--nproc-per-node", str(nproc), "--steps", str(args.steps),
           "--host-memory-gb", str(host_gb), "--out", out] + [x for o in args.overrides for x in ("--set", o)] + (
        ["--steps-only"] if args.steps_only else [])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        code, other = follow(cmd, env, err,
                             lambda name: say(f"rank {rank}: {name} (at {time.perf_counter() - t0:.0f} s)"))
        err.seek(0)
        stderr = err.read()
    if code != 0:
        lines = (stderr or "".join(other) or f"exit status {code}").strip().splitlines()
        return rank, {}, lines[-1]
    with open(out) as f:
        figures = json.load(f)
    figures["seconds"]["process"] = time.perf_counter() - t0
    return rank, figures, ""


def follow(cmd: list, env: dict, err, on_phase) -> tuple[int, list]:
    """Run a rank's process (stderr to the file ``err``: a pipe nobody reads could fill and stall it); each of its
    progress lines goes to ``on_phase`` as it comes. Returns the exit status and the other lines of its stdout."""
    other = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env) as proc:
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                on_phase(line[len(PROGRESS):].rstrip("\n"))
            else:
                other.append(line)
    return proc.returncode, other


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_lc.config import ConfigError, load_config, resolve_layout
    from megatron_lc.estimate import load_hardware
    from megatron_lc.rehearsal.report import attention_line, one_step_note, phase_lines, plot, summarize, summary_line
    from megatron_lc.units import GIB

    try:
        cfg = load_config(args.config, args.overrides)
        hw = load_hardware(args.hardware)
        nproc = args.nproc_per_node or hw.gpus_per_node
        world = nproc * args.nnodes
        layout = resolve_layout(cfg, world)  # one line for an impossible layout, before any process starts
        ranks = rank_list(args.ranks, world)
        if args.steps < 1 or args.jobs < 1:
            raise ConfigError(f"--steps ({args.steps}) and --jobs ({args.jobs}) must be >= 1")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    host_gb = hw.host_bytes_per_node / GIB
    print(f"rehearsing {len(ranks)} of {world} ranks ({nproc} per node), {args.steps} steps each: tp {layout.tp} "
          f"cp {layout.cp} ({layout.cp_comm_type}) dp {layout.dp}, {cfg.data.seq_length:,} tokens", flush=True)
    results, failed = {}, []
    with tempfile.TemporaryDirectory() as d, ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(run_rank, args, r, world, nproc, host_gb, os.path.join(d, f"rank{r}.json"))
                for r in ranks]
        for job in jobs:
            rank, figures, error = job.result()
            if error:
                failed.append(rank)
                with _SAY:
                    print(f"rank {rank}: failed: {error}", file=sys.stderr, flush=True)
                continue
            results[rank] = figures
            dev = figures["device"]
            say(f"rank {rank}: peak device {dev['peak_bytes'] / GIB:.2f} GiB at {dev['peak_moment']}; setup "
                f"{dev['setup_peak_bytes'] / GIB:.2f} GiB; host {figures['host']['peak_bytes'] / GIB:.2f} GiB; "
                f"{figures['seconds']['process']:.0f} s")
            for v in figures["violations"]:
                say(f"rank {rank}: {v['text']}")
            if figures.get("stopped"):
                say(f"rank {rank}: stopped at {figures['stopped']['at']}, where the op above raises on CUDA")
    if failed:
        print(f"error: the rehearsal of rank(s) {', '.join(map(str, failed))} failed (above)", file=sys.stderr)
        return 1
    summary = summarize(cfg, hw, world, results, args.steps)
    report = {"config": args.config, "overrides": args.overrides, "hardware": hw.name, "steps": args.steps,
              "layout": {"tp": layout.tp, "cp": layout.cp, "cp_comm_type": layout.cp_comm_type, "dp": layout.dp,
                         "ulysses": layout.ulysses, "world": world, "nproc_per_node": nproc},
              "summary": summary, "ranks": {str(k): v for k, v in sorted(results.items())}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(results, summary, args.plot)
    sent = summary["layer0_attention_bytes"]
    if sent:
        print("layer 0 attention sent per step by a rank: " + ", ".join(
            f"{k} {sent['rehearsed'].get(k, 0) / GIB:.2f} GiB (formula {sent['formula'][k] / GIB:.2f})"
            for k in ("fwd", "bwd")))
    if attention_line(summary):
        print(attention_line(summary))
    moe = summary["expert_all_to_all_bytes"]
    if moe:  # no router values in a rehearsal: every rank receives the stated worst-case load
        print("experts' all-to-all sent per step by a rank: " + ", ".join(
            f"{k} {moe['rehearsed'].get(k, 0) / GIB:.2f} GiB (estimator {moe['formula'][k] / GIB:.2f})"
            for k in ("fwd", "bwd")) + f"; each expert rank received {moe['load']:g} x its fair share of the "
            f"copies (the stated worst case: a rehearsal has no router values)")
    for line in phase_lines(summary):
        print(line)
    if args.steps < 2:
        print(one_step_note(summary))
    print(summary_line(summary))
    return 0 if summary["fits"] and not summary["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
