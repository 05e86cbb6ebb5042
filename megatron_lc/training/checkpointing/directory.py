"""The ``checkpoint.save`` directory: which checkpoints in it are complete, which is newest, what a killed save left
behind, and the atomic writes a save is made of (``checkpoint.py`` writes and loads the checkpoints themselves).

    runs/x/iter_0000004/           complete: its meta.json exists (written last)
    runs/x/iter_0000006.tmp/       a save killed midway: ignored, removed by the next save
    runs/x/iter_0000006.old/       a re-save of 6 killed between its two renames: loaded when iter_0000006/ is not
                                   complete, removed once it is
    runs/x/latest_checkpointed_iteration.txt   a hint (Megatron's name), re-checked against the directories
    runs/x/run_outcome.txt         how the last run on the directory ended, one line (``write_outcome``)

``checkpoints_newest_first("runs/x")`` -> ``["runs/x/iter_0000006.old", "runs/x/iter_0000004"]`` here.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Optional

import torch

from ...config import Config, ConfigError

LATEST = "latest_checkpointed_iteration.txt"
OUTCOME = "run_outcome.txt"
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".part"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_outcome(save: str, outcome: str, detail: str) -> None:
    """``<save>/run_outcome.txt``: one line, ``OUTCOME: detail``, how the run holding the directory ended --
    ``finished`` (train.train_iters reached, its checkpoint written), ``stopped`` (a signal or the time limit: the
    ranks agreed on a step and its checkpoint is written; resuming goes on) or ``failed`` (the one-line error). Written
    atomically by rank 0 at the end; a run that takes the directory removes the previous one (``clear_outcome``), so
    a run killed before its end leaves none. ``scripts/slurm/launch.sh`` requeues a job only on ``stopped``."""
    atomic_write_text(os.path.join(save, OUTCOME), f"{outcome}: {' '.join(detail.split())}\n")


def clear_outcome(save: str) -> None:
    try:
        os.unlink(os.path.join(save, OUTCOME))
    except FileNotFoundError:
        pass


def iter_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def saved_after_an_update(path: str) -> bool:
    """Whether checkpoint ``path`` was saved after a step that updated the weights (its meta.json's
    ``skipped_in_a_row`` is 0 or absent); an unreadable meta.json: no."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return not json.load(f).get("skipped_in_a_row")
    except (OSError, ValueError, AttributeError):
        return False


def newest_good_checkpoint(save: str) -> Optional[str]:
    """The newest complete checkpoint of ``save`` saved after a step that updated the weights, or None."""
    dirs = complete_checkpoints(save)
    return next((dirs[it] for it in sorted(dirs, reverse=True) if saved_after_an_update(dirs[it])), None)


def prune(save: str, keep_last: Optional[int]) -> None:
    """Keep the newest ``keep_last`` checkpoints saved after a step that updated the weights, and every checkpoint
    newer than the oldest of them; remove the older ones. So checkpoints saved during a run of skipped steps never
    push a good one out. Example, keep_last 2, iterations 1-5 where 3-5 were saved while steps were skipped:
    nothing is removed (the two good ones are 1 and 2)."""
    if not keep_last:
        return
    dirs = complete_checkpoints(save)
    good = [it for it in sorted(dirs) if saved_after_an_update(dirs[it])]
    if len(good) <= keep_last:
        return
    for it in sorted(dirs):
        if it < good[-keep_last]:
            shutil.rmtree(dirs[it], ignore_errors=True)


def remove_leftovers(save: str) -> list[str]:
    """Remove ``iter_*.tmp`` of saves that did not finish, and ``.old`` copies whose iteration is complete again;
    returns the removed ``.tmp`` directories. Only a run holding the directory's lock (``save_lock.py``) saves, so
    these are never another live run's files."""
    removed = []
    for name in sorted(os.listdir(save)):
        path = os.path.join(save, name)
        if re.fullmatch(r"iter_\d{7}\.tmp", name):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        elif re.fullmatch(r"iter_\d{7}\.old", name) and os.path.isfile(os.path.join(path[:-4], "meta.json")):
            shutil.rmtree(path, ignore_errors=True)
    return removed


def unfinished_saves(save: str) -> list[str]:
    """``iter_*.tmp`` directories of saves that did not finish (ignored by a resume)."""
    if not os.path.isdir(save):
        return []
    return [os.path.join(save, n) for n in sorted(os.listdir(save)) if re.fullmatch(r"iter_\d{7}\.tmp", n)]


def set_aside(path: str) -> str:
    """Rename a checkpoint that does not load to ``<path>.corrupt`` (``.corrupt.1`` ... if taken), so that no later
    save overwrites it and no resume picks it; returns the new name."""
    new, n = path + ".corrupt", 0
    while os.path.exists(new):
        n += 1
        new = f"{path}.corrupt.{n}"
    os.replace(path, new)
    return new


def complete_checkpoints(save: str) -> dict[int, str]:
    """Complete checkpoint directories by iteration: ``iter_N``, else ``iter_N.old`` (a re-save of N killed
    between its two renames). A directory is complete when it has its ``meta.json`` (written last)."""
    if not os.path.isdir(save):
        return {}
    out: dict[int, str] = {}
    for name in sorted(os.listdir(save)):
        m = re.fullmatch(r"iter_(\d{7})(\.old)?", name)
        if m and os.path.isfile(os.path.join(save, name, "meta.json")):
            it = int(m.group(1))
            if m.group(2) is None or it not in out:
                out[it] = os.path.join(save, name)
    return out


def complete_iterations(save: str) -> list[int]:
    """Iterations with a complete checkpoint directory, ascending."""
    return sorted(complete_checkpoints(save))


def checkpoints_newest_first(load: str) -> list[str]:
    """Complete checkpoint directories under ``load`` (or ``load`` itself if it is one), newest first."""
    if os.path.isfile(os.path.join(load, "meta.json")):
        return [load]
    dirs = complete_checkpoints(load)
    return [dirs[it] for it in sorted(dirs, reverse=True)]


def find_latest(load: str) -> Optional[str]:
    """Directory of the newest complete checkpoint under ``load`` (or ``load`` itself if it is one)."""
    found = checkpoints_newest_first(load)
    return found[0] if found else None


def is_hf_model_dir(path: str) -> bool:
    """A Hugging Face model directory (``config.json`` beside safetensors / PyTorch weights)."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, f)) for f in HF_WEIGHTS)


def same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return bool(a and b) and os.path.abspath(a) == os.path.abspath(b)


def check_save_dir(cfg: Config) -> None:
    """Refuse to save into a directory that holds another run's checkpoints (resuming it is ``load == save``). The
    error names both ways on: resume that run, or give this one its own directory -- a config's ``checkpoint.save``
    is shared by every run of it (the demo's and each variant of its command line)."""
    save, load = cfg.checkpoint.save, cfg.checkpoint.load
    if not save or same_dir(save, load):
        return
    done = complete_iterations(save)
    if done:
        raise ConfigError(f"checkpoint.save ({save}) already holds a run (checkpoints up to iteration {done[-1]}): "
                          f"to resume that run add --set checkpoint.load={save}; to start another, give it its own "
                          f"directory with --set checkpoint.save=NEW_DIR")


def read_meta(path: str) -> dict:
    """``path``'s meta.json; unreadable, truncated or not an object: a ``ConfigError`` naming it."""
    f = os.path.join(path, "meta.json")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f} is unreadable or truncated ({e})") from None
    missing = [k for k in ("iteration", "consumed_samples", "world_size", "tp", "cp", "dp", "config")
               if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ConfigError(f"{f} is incomplete (no {', '.join(missing)})")
    return meta
