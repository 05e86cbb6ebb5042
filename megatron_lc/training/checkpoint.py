"""Atomic checkpoints and resume.

Layout of ``checkpoint.save``::

    iter_0000006/                     one complete checkpoint (a directory appears under this name only complete)
        meta.json                     iteration, consumed samples, layout, the full config
        model_tp00.pt ...             model shard of each tp rank (written by dp x cp rank 0 of its tp group)
        optim_tp00.pt ...             optimizer + scheduler state (ZeRO-1: optim_tp00_dpcp0003.pt, one per rank)
        rng_rank00000.pt ...          RNG states of every rank
    latest_checkpointed_iteration.txt newest complete iteration (written by rename; a hint, re-checked on load)

A save writes into ``iter_0000006.tmp/`` and renames it when every rank has finished, so a save killed midway
leaves the previous checkpoint intact; ``find_latest`` ignores ``*.tmp`` directories and picks the newest
directory with a ``meta.json``. Re-saving an existing iteration moves the old one to ``iter_0000006.old/`` first;
if the save dies between the two renames, the ``.old`` copy is found and loaded. The next save removes leftover
``*.tmp`` directories and ``.old`` copies that have a complete twin.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..parallel.topology import Axis, Topology

FORMAT_VERSION = 1
LATEST = "latest_checkpointed_iteration.txt"


def _barrier(topo: Topology) -> None:
    if topo.world_size > 1:
        dist.barrier()


def _atomic_torch_save(obj, path: str) -> None:
    tmp = path + ".part"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".part"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def iter_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _zero(opt) -> bool:
    return type(opt).__name__ == "ZeroRedundancyOptimizer"


def _optim_file(topo: Topology, opt) -> Optional[str]:
    """This rank's optimizer file name, or None when another rank writes the identical state."""
    if _zero(opt):
        return f"optim_tp{topo.tp_rank:02d}_dpcp{topo.axis_rank(Axis.DP_CP):04d}.pt"
    return f"optim_tp{topo.tp_rank:02d}.pt" if topo.axis_rank(Axis.DP_CP) == 0 else None


def _optim_state(opt) -> dict:
    return opt.optim.state_dict() if _zero(opt) else opt.state_dict()


def save_checkpoint(cfg: Config, topo: Topology, model, opt, iteration: int, consumed_samples: int,
                    extra: Optional[dict] = None) -> str:
    """Write the checkpoint of ``iteration`` atomically; every rank must call this. Returns its directory."""
    save = cfg.checkpoint.save
    final = iter_dir(save, iteration)
    tmp = final + ".tmp"
    if topo.rank == 0:
        os.makedirs(save, exist_ok=True)
        _remove_leftovers(save)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(topo)
    if topo.axis_rank(Axis.DP_CP) == 0:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        _atomic_torch_save(state, os.path.join(tmp, f"model_tp{topo.tp_rank:02d}.pt"))
    name = _optim_file(topo, opt)
    if name is not None:
        _atomic_torch_save(_optim_state(opt), os.path.join(tmp, name))
    _atomic_torch_save(rng_state(), os.path.join(tmp, f"rng_rank{topo.rank:05d}.pt"))
    _barrier(topo)
    if topo.rank == 0:
        meta = {"format_version": FORMAT_VERSION, "iteration": iteration, "consumed_samples": consumed_samples,
                "world_size": topo.world_size, "tp": topo.tp, "cp": topo.cp, "dp": topo.dp,
                "zero": _zero(opt), "config": cfg.to_dict(), **(extra or {})}
        _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
        if os.path.isdir(final):  # re-saving the same iteration: move the old one aside first
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _atomic_write_text(os.path.join(save, LATEST), str(iteration))
        _prune(save, cfg.checkpoint.keep_last)
    _barrier(topo)
    return final


def _prune(save: str, keep_last: Optional[int]) -> None:
    if not keep_last:
        return
    dirs = complete_checkpoints(save)
    for it in sorted(dirs)[:-keep_last]:
        shutil.rmtree(dirs[it], ignore_errors=True)


def _remove_leftovers(save: str) -> None:
    """Remove ``iter_*.tmp`` of saves that were killed, and ``.old`` copies whose iteration is complete again."""
    for name in os.listdir(save):
        path = os.path.join(save, name)
        if re.fullmatch(r"iter_\d{7}\.tmp", name):
            shutil.rmtree(path, ignore_errors=True)
        elif re.fullmatch(r"iter_\d{7}\.old", name) and os.path.isfile(os.path.join(path[:-4], "meta.json")):
            shutil.rmtree(path, ignore_errors=True)


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


def find_latest(load: str) -> Optional[str]:
    """Directory of the newest complete checkpoint under ``load`` (or ``load`` itself if it is one)."""
    if os.path.isfile(os.path.join(load, "meta.json")):
        return load
    dirs = complete_checkpoints(load)
    return dirs[max(dirs)] if dirs else None


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"checkpoint {path}: meta.json unreadable ({e})") from None


def check_compatible(meta: dict, cfg: Config, topo: Topology, path: str, zero: bool) -> None:
    """A checkpoint of another model or layout -> ConfigError naming every differing key."""
    saved = meta["config"]["model"]
    now = cfg.to_dict()["model"]
    diffs = [f"model.{k}={saved.get(k)!r} (this run: {now[k]!r})" for k in now if saved.get(k) != now[k]]
    if diffs:
        raise ConfigError(f"checkpoint {path} was saved for another model: " + "; ".join(diffs))
    if meta["tp"] != topo.tp:
        raise ConfigError(f"checkpoint {path} has tp={meta['tp']} shards, this run has tp={topo.tp}; "
                          f"resume with parallel.tensor_model_parallel_size={meta['tp']}")
    if meta["zero"] and (not zero or meta["dp"] * meta["cp"] != topo.dp * topo.cp):
        raise ConfigError(f"checkpoint {path} holds ZeRO-1 optimizer shards for dp*cp={meta['dp'] * meta['cp']}; "
                          f"this run has use_distributed_optimizer={zero}, dp*cp={topo.dp * topo.cp}")


def load_checkpoint(cfg: Config, topo: Topology, model, opt) -> Optional[dict]:
    """Resume from ``cfg.checkpoint.load`` if it holds a checkpoint; returns its meta (or None: fresh start)."""
    load = cfg.checkpoint.load
    if not load:
        return None
    path = find_latest(load)
    if path is None:
        return None
    meta = read_meta(path)
    check_compatible(meta, cfg, topo, path, _zero(opt))
    model_file = os.path.join(path, f"model_tp{topo.tp_rank:02d}.pt")
    state = torch.load(model_file, map_location="cpu", weights_only=True)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"checkpoint {model_file} does not match the model: missing {missing[:5]}, "
                          f"unexpected {unexpected[:5]}")
    name = (f"optim_tp{topo.tp_rank:02d}_dpcp{topo.axis_rank(Axis.DP_CP):04d}.pt" if _zero(opt)
            else f"optim_tp{topo.tp_rank:02d}.pt")
    ostate = torch.load(os.path.join(path, name), map_location="cpu", weights_only=False)
    (opt.optim if _zero(opt) else opt).load_state_dict(ostate)
    rng_file = os.path.join(path, f"rng_rank{topo.rank:05d}.pt")
    if os.path.isfile(rng_file) and meta["world_size"] == topo.world_size:
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=False))
    meta["path"] = path
    return meta
