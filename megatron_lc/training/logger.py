"""Where metrics go: a console line per log interval, ``metrics.jsonl`` (one JSON object per step), wandb, and on a
terminal a progress bar over the steps with the time left (``StepBar``).

Only rank 0 writes. wandb is used when ``logging.wandb_project`` is set, in ``logging.wandb_mode`` (offline by
default: runs are written under the wandb dir and can be synced later with ``wandb sync``)."""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from typing import Optional

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..config import Config

log = logging.getLogger("megatron_lc")


def metrics_path(cfg: Config) -> Optional[str]:
    """``logging.metrics_file``, else ``<checkpoint.save>/metrics.jsonl``, else None (console only)."""
    if cfg.logging.metrics_file:
        return cfg.logging.metrics_file
    if cfg.checkpoint.save:
        return os.path.join(cfg.checkpoint.save, "metrics.jsonl")
    return None


class MetricsLogger:
    """Rank 0 appends one JSON line per step to the metrics file. A resumed run first appends a ``resumed_from``
    record (``tools/plot_metrics.py`` marks it); a fresh run never appends to an earlier run's file: that file is
    moved aside (``metrics.jsonl`` -> ``metrics.1.jsonl``, the first free number) and the move logged."""

    def __init__(self, cfg: Config, rank: int, resumed: Optional[dict] = None):
        self.cfg, self.rank = cfg, rank
        self.path: Optional[str] = None
        self.wandb = None
        if rank != 0:
            return
        self.path = metrics_path(cfg)
        if self.path is None:
            log.info("metrics go to the console only (set logging.metrics_file or checkpoint.save for a file)")
        else:
            self._open(resumed)
        if cfg.logging.wandb_project:
            import wandb  # optional (the ``wandb`` extra): only when logging.wandb_project is set

            self.wandb = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                                    dir=cfg.logging.wandb_dir or os.path.dirname(os.path.abspath(self.path or ".")),
                                    config=cfg.to_dict())

    def _open(self, resumed: Optional[dict]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        if resumed is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"resumed_from": resumed["path"], "step": resumed["iteration"]}) + "\n")
        elif os.path.isfile(self.path) and os.path.getsize(self.path) > 0:
            stem, ext = os.path.splitext(self.path)
            n = 1
            while os.path.exists(f"{stem}.{n}{ext}"):
                n += 1
            os.replace(self.path, f"{stem}.{n}{ext}")
            log.warning("%s held an earlier run's metrics: moved to %s", self.path, f"{stem}.{n}{ext}")

    def _write(self, record: dict, wandb_values: dict) -> None:
        """One line of the metrics file and one wandb entry at the record's step (rank 0 only)."""
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log(wandb_values, step=record["step"])

    def log_step(self, record: dict) -> None:
        if self.rank != 0:
            return
        self._write(record, {k: v for k, v in record.items() if isinstance(v, (int, float))})
        step = record["step"]  # the first step too: a sign of life before the first interval
        if step == 1 or step % self.cfg.logging.log_interval == 0 or step == self.cfg.train.train_iters:
            log.info(format_line(record))

    def log_eval(self, record: dict) -> None:
        """A validation / test record (``validate.Validator``): a line of the metrics file (its ``eval`` key tells it
        from the step records), ``valid/loss`` and ``valid/perplexity`` in wandb, and the console."""
        if self.rank != 0:
            return
        self._write(record, {f"{record['eval']}/{k}": record[k] for k in ("loss", "perplexity")})
        log.info("%s at step %d | %s loss %.4f | perplexity %.3f | %d samples, %d tokens | %.2fs", record["eval"],
                 record["step"], record["eval"], record["loss"], record["perplexity"], record["samples"],
                 record["tokens"], record["seconds"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class StepBar:
    """Rank 0's progress bar over the steps, with the time left (tqdm's ETA) and the last loss, on stderr when it is
    a terminal: not in a log file, a pipe or the tests. While it is shown the console log lines (every step line,
    validation, warnings) are written above it (``logging_redirect_tqdm``); ``close`` puts the logging back."""

    def __init__(self, rank: int, total: int, done: int):
        self.stack = contextlib.ExitStack()
        self.bar = None
        if rank == 0 and sys.stderr.isatty():
            self.stack.enter_context(logging_redirect_tqdm())  # entered first, left last: after the bar's close
            self.bar = self.stack.enter_context(tqdm(total=total, initial=done, desc="training", unit="step",
                                                     file=sys.stderr, dynamic_ncols=True))

    def update(self, record: dict) -> None:
        if self.bar is None:
            return
        if record["loss"] is not None:
            self.bar.set_postfix_str(f"loss {record['loss']:.4f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.stack.close()


def format_line(r: dict) -> str:
    parts = [f"step {r['step']:>6}/{r['train_iters']}", f"loss {r['loss']:.4f}", f"lr {r['lr']:.3e}",
             f"grad_norm {r['grad_norm']:.3f}", f"tok/s {r['tokens_per_s']:.0f}",
             f"tok/gpu/s {r['tokens_per_gpu_per_s']:.0f}",
             "MFU n/a" if r["mfu"] is None else f"MFU {100 * r['mfu']:.2f}%",
             "peak_mem n/a" if r["peak_memory_bytes"] is None else f"peak_mem {r['peak_memory_bytes'] / 2**30:.2f}GiB",
             f"{r['step_seconds']:.2f}s"]
    if r.get("moe_aux_loss") is not None:  # an MoE model's load-balancing loss
        parts.insert(2, f"moe_aux_loss {r['moe_aux_loss']:.4f}")
    if r.get("skipped"):
        parts.append("SKIPPED (non-finite)")
    return " | ".join(parts)


def duration(seconds: float) -> str:
    """``38.2 s``, ``2 min 41 s``, ``1 h 05 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def process_seconds() -> Optional[float]:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time on the boot clock), None where
    that cannot be read. The summary's whole time: imports, data preparation and setup before the first step."""
    try:
        with open("/proc/self/stat") as f:
            start = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        return time.clock_gettime(time.CLOCK_BOOTTIME) - start / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def format_summary(first: int, losses: list, iters: int, seconds: float, process: Optional[float],
                   stop: Optional[str], checkpoint: Optional[str], metrics: Optional[str]) -> str:
    """The run's last line: its steps (``first`` .. ``first + len(losses) - 1`` of ``iters``) and their time, the
    process's (``process_seconds``), the first and last loss and the mean of the last ten steps' finite losses, where
    the checkpoint and metrics are. E.g. ``done: steps 1-100 of 100 in 8 min 33 s (the process: 9 min 37 s) | loss
    9.0579 at step 1, 4.2596 at step 100, mean 4.6004 over steps 91-100 | checkpoint runs/tiny_cpu/iter_0000100 |
    metrics runs/tiny_cpu/metrics.jsonl``. Losses are None in a rehearsal (no values): left out."""
    last = first + len(losses) - 1
    head = "done" if stop is None else f"stopped ({stop})"
    whole = f" (the process: {duration(process)})" if process is not None else ""
    parts = [f"{head}: steps {first}-{last} of {iters} in {duration(seconds)}{whole}"]
    if losses and losses[0] is not None:
        window = losses[-10:]
        tail = [x for x in window if math.isfinite(x)]
        skipped = f" ({len(window) - len(tail)} skipped)" if len(tail) < len(window) else ""
        mean = f", mean {sum(tail) / len(tail):.4f} over steps {last - len(window) + 1}-{last}{skipped}" if tail else ""
        parts.append(f"loss {losses[0]:.4f} at step {first}, {losses[-1]:.4f} at step {last}{mean}")
    parts.append(f"checkpoint {checkpoint}" if checkpoint else "no checkpoint (checkpoint.save unset)")
    parts.append(f"metrics {metrics}" if metrics else "metrics on the console only")
    return " | ".join(parts)
