"""Atomic checkpoints and resume.

Layout of ``checkpoint.save``::

    iter_0000006/                     one complete checkpoint (a directory appears under this name only complete)
        meta.json                     iteration, consumed samples, layout, the full config, every file's checksum
        .metadata, __0_0.distcp ...   weights and AdamW states, torch.distributed.checkpoint (``sharded_state.py``:
                                      layout-free keys, each rank writes its pieces, any layout reads them)
        rng_rank00000.pt ...          RNG states of every rank (restored when the world size is the same)
    latest_checkpointed_iteration.txt newest complete iteration (written by rename; a hint, re-checked on load)

The learning-rate schedule is a function of the iteration, and the data position is the consumed-sample count in
``meta.json``: with the weights and AdamW states that is the whole training state, so a run saved at one (tp, cp,
dp, ZeRO-1 or not) resumes at any other. Checkpoints of format 2 (``model_tp00.pt``, ``optim_tp00.pt``: one torch
file per tp rank) still load, resharded across tp by ``reshard.py`` (their ZeRO-1 states only at their own layout).

``meta.json`` lists every file with its size and SHA-256 (the ranks share the hashing). A resume checks every
file before loading (format 2: the files a rank reads); a missing, truncated or corrupt file names itself in one
line, and with ``checkpoint.load_fallback`` (the default) every rank falls back together to the newest older
checkpoint that loads (logged). ``checkpoint.load`` that does not exist, holds no checkpoint, or is a Hugging Face
model directory is an error -- except ``load == save`` with nothing saved yet, the first start of an auto-resuming
job. A ``save`` directory that already holds another run's checkpoints is refused unless this run resumes it
(``load == save``).

A save writes into ``iter_0000006.tmp/`` and renames it when every rank has finished, so a save killed midway
leaves the previous checkpoint intact; ``find_latest`` ignores ``*.tmp`` directories and picks the newest
directory with a ``meta.json``. Re-saving an existing iteration moves the old one to ``iter_0000006.old/`` first;
if the save dies between the two renames, the ``.old`` copy is found and loaded. The next save removes leftover
``*.tmp`` directories and ``.old`` copies that have a complete twin (these rules: ``checkpoint_dir.py``).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from typing import Optional


from ...config import Config, ConfigError, ModelConfig
from ...parallel.collectives import all_gather_objects
from ...parallel.topology import Axis, Topology
from . import sharded_state
from .common import FORMAT_VERSION, file_checksums, file_digest, file_share, leads, uses_zero
from .data_only import DataOnlyReader, UntrustedCheckpointError, load_torch_file, set_rng_state
from .directory import (LATEST, atomic_write_text, checkpoints_newest_first, is_hf_model_dir, iter_dir, read_meta,
                        same_dir, set_aside, unfinished_saves)
from .reshard import check_tp_change, merged_model_state, model_state_for, optimizer_state_for
from .sharded_state import ShardedState

log = logging.getLogger("megatron_lc")


def write_model_checkpoint(save: str, cfg: Config, full: dict, extra: Optional[dict] = None) -> str:
    """A weights-only checkpoint at iteration 0 (an import) of the full weights ``{name: tensor}``, written by this
    process alone, atomically like a training save, with checksums; it loads at any layout, and
    ``"optimizer": false`` tells a resume to start AdamW afresh."""
    final = iter_dir(save, 0)
    if os.path.isdir(final):
        raise ConfigError(f"{final} already exists; import into an empty directory")
    tmp = final + ".tmp"
    os.makedirs(save, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    sharded_state.write_full_model(tmp, cfg, full)
    meta = {"format_version": FORMAT_VERSION, "iteration": 0, "consumed_samples": 0, "world_size": 1, "tp": 1,
            "cp": 1, "dp": 1, "zero": False, "optimizer": False, "config": cfg.to_dict(),
            "files": file_checksums(tmp, None), **(extra or {})}
    atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=1))
    os.replace(tmp, final)
    atomic_write_text(os.path.join(save, LATEST), "0")
    return final


def full_weights(path: str, meta: dict, cfg: Config) -> dict:
    """The full (unsharded) model weights of checkpoint directory ``path`` (either format), read by this process
    alone: for exports and tools. A missing or corrupt file is a ``ConfigError`` naming it."""
    problem = _check_files(path, meta, sorted(n for n in meta.get("files", {}) if not n.startswith("rng_"))
                           if meta.get("format_version", 1) >= 3 else
                           [f"model_tp{r:02d}.pt" for r in range(meta["tp"])])
    if problem is not None:
        raise ConfigError(problem)
    try:
        if meta.get("format_version", 1) >= 3:
            return sharded_state.full_model_state(path, cfg)
        return merged_model_state(path, cfg, meta["tp"])
    except ConfigError:
        raise
    except Exception as e:  # DCP / torch.load failures: one line
        raise ConfigError(f"checkpoint {path} does not load ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[-1][:160] if str(e).strip() else ''})") from None


# model fields that change a parameter's shape or meaning; the others (rotary_base, rope_scaling, norm_epsilon,
# init_method_std, max_position_embeddings under RoPE) may change between the stages of a run, said in the log
SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "normalization", "swiglu",
                "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear",
                "add_qkv_bias", "qk_layernorm", "apply_layernorm_1p", "post_self_attn_layernorm", "post_mlp_layernorm",
                "gated_linear_unit", "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


def _saved_model(saved: dict) -> dict:
    """A checkpoint's model section with every field of this version: a field it predates takes the value that
    version meant (``ModelConfig``'s default, resolved as then: ``gated_linear_unit`` = ``swiglu``)."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    return {**ModelConfig(**{k: v for k, v in saved.items() if k in known}).__dict__, **saved}


def check_compatible(meta: dict, cfg: Config, topo: Topology, path: str, zero: bool, load_optim: bool = True) -> None:
    """A checkpoint of another model -> ConfigError naming every differing shape field; other model changes are
    logged; a ZeRO-1 checkpoint at another layout -> ConfigError (``reshard.check_tp_change``)."""
    saved = _saved_model(meta["config"]["model"])
    now = cfg.to_dict()["model"]
    shape = list(SHAPE_FIELDS) + (["max_position_embeddings"] if now["position_embedding_type"] != "rope" else [])
    diffs = [f"model.{k}={saved.get(k)!r} (this run: {now[k]!r})" for k in shape if saved.get(k) != now[k]]
    if diffs:
        raise ConfigError(f"checkpoint {path} was saved for another model: " + "; ".join(diffs))
    changed = [f"model.{k} {saved.get(k)!r} -> {now[k]!r}" for k in now if k not in shape and saved.get(k) != now[k]]
    if changed and leads(topo):
        log.info("checkpoint %s: continuing with %s", path, ", ".join(changed))
    c = cfg.checkpoint
    if meta.get("format_version", 1) >= 3:  # DCP: any layout
        return
    if cfg.parallel.use_torch_fsdp2:
        raise ConfigError(f"checkpoint {path} is of format {meta.get('format_version', 1)} (torch files per tp rank) "
                          f"and parallel.use_torch_fsdp2 loads format {FORMAT_VERSION} only: resume it once without "
                          f"FSDP2 and let it save (any layout), then go on with FSDP2")
    problem = check_tp_change(meta, topo, zero, load_optim and not (c.no_load_optim or c.finetune))
    if problem is not None:
        raise ConfigError(f"checkpoint {path} {problem}")


def _param_names(model, opt) -> list[str]:
    """Parameter names in the optimizer's index order (its param groups, in order)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for g in opt.param_groups for p in g["params"]]


def _check_files(path: str, meta: dict, names: list[str]) -> Optional[str]:
    """Why this rank cannot load ``names`` from checkpoint ``path`` (missing, size or sha256 differs), or None."""
    listed = meta.get("files")
    for name in names:
        f = os.path.join(path, name)
        if not os.path.isfile(f):
            return f"{f} is missing"
        if listed is None:  # format 1: no checksums (torch.load errors still name the file)
            continue
        want = listed.get(name)
        if want is None:
            return f"{f} is not listed in its meta.json"
        if os.path.getsize(f) != want["bytes"]:
            return f"{f} is truncated or corrupt ({os.path.getsize(f)} bytes, saved {want['bytes']})"
        if file_digest(f)["sha256"] != want["sha256"]:
            return f"{f} is corrupt (sha256 differs from its meta.json)"
    return None


def _load_torch_files_per_tp(path: str, meta: dict, cfg: Config, topo: Topology, model, opt) -> Optional[str]:
    """Load this rank's share of a format-2 checkpoint ``path`` (one torch file per tp rank:
    ``model_tp00.pt``, ``optim_tp00.pt`` ...) (resharded when it was saved at another tp); returns
    why it could not (naming the file), or None."""
    c, tp = cfg.checkpoint, meta["tp"]
    load_optim = opt is not None and not (c.no_load_optim or c.finetune) and meta.get("optimizer", True)
    same_tp = tp == topo.tp
    names = [f"model_tp{topo.tp_rank:02d}.pt"] if same_tp else [f"model_tp{r:02d}.pt" for r in range(tp)]
    if load_optim:
        names += ([f"optim_tp{topo.tp_rank:02d}_dpcp{topo.axis_rank(Axis.DP_CP):04d}.pt"] if uses_zero(opt) else
                  [f"optim_tp{topo.tp_rank:02d}.pt"] if same_tp else [f"optim_tp{r:02d}.pt" for r in range(tp)])
    rng_file = f"rng_rank{topo.rank:05d}.pt"
    restore_rng = (opt is not None and meta["world_size"] == topo.world_size and not (c.no_load_rng or c.finetune)
                   and os.path.isfile(os.path.join(path, rng_file)))
    problem = _check_files(path, meta, names + ([rng_file] if restore_rng else []))
    if problem is not None:
        return problem
    name = names[0]
    try:
        state = model_state_for(path, cfg, tp, topo)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ConfigError(f"checkpoint {os.path.join(path, name)} does not match the model: missing "
                              f"{missing[:5]}, unexpected {unexpected[:5]}")
        if load_optim:
            name = names[-1]
            if uses_zero(opt):
                opt.optim.load_state_dict(load_torch_file(os.path.join(path, name), c.trust_pickle))
            else:
                opt.load_state_dict(optimizer_state_for(path, cfg, tp, topo, _param_names(model, opt)))
        if restore_rng:
            name = rng_file
            set_rng_state(load_torch_file(os.path.join(path, name), c.trust_pickle))
    except (RuntimeError, OSError, EOFError, ValueError, KeyError) as e:
        if isinstance(e, ConfigError):
            raise
        return f"{os.path.join(path, name)} does not load ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    return None


def _wants(meta: dict, cfg: Config, topo: Topology, opt) -> tuple[bool, Optional[str]]:
    """(load the optimizer states?, this rank's RNG file to restore or None)."""
    c = cfg.checkpoint
    load_optim = opt is not None and not (c.no_load_optim or c.finetune) and meta.get("optimizer", True)
    rng_file = f"rng_rank{topo.rank:05d}.pt"
    restore = (opt is not None and meta["world_size"] == topo.world_size and not (c.no_load_rng or c.finetune)
               and rng_file in meta.get("files", {}))
    return load_optim, (rng_file if restore else None)


def _check_dcp_files(path: str, meta: dict, cfg: Config, topo: Topology) -> tuple[Optional[str], Optional[str]]:
    """(refusal, problem) of this rank's share of the files and, on rank 0, of DCP's metadata read as data."""
    problem = _check_files(path, meta, file_share(list(meta["files"]), topo))
    if problem is None and leads(topo):
        try:
            DataOnlyReader(path, cfg.checkpoint.trust_pickle).read_metadata()
        except UntrustedCheckpointError as e:
            return str(e), None
        except (OSError, EOFError) as e:
            return None, f"{os.path.join(path, '.metadata')} does not load ({e})"
    return None, problem


def _load_dcp(path: str, meta: dict, cfg: Config, topo: Topology, model, opt) -> Optional[str]:
    """Load a DCP checkpoint (collective: every rank calls it); returns why it could not, the same on every rank,
    or None. Every file is checked first, each by one rank; then DCP reads the pieces of this layout."""
    load_optim, rng_file = _wants(meta, cfg, topo, opt)
    outcomes = all_gather_objects(_check_dcp_files(path, meta, cfg, topo))  # agreed before DCP's collectives
    refused = [r for r, _ in outcomes if r is not None]
    if refused:
        raise UntrustedCheckpointError(refused[0])
    problems = [p for _, p in outcomes if p is not None]
    if problems:
        return problems[0]
    state = ShardedState(model, topo)
    target, install = state.model_state(), []
    if load_optim:
        optim, install = state.optimizer_targets(opt)
        target.update(optim)
    try:
        sharded_state.read(path, target, trust_pickle=cfg.checkpoint.trust_pickle)
    except UntrustedCheckpointError:
        raise  # raised on every rank (DCP shares each rank's failure)
    except Exception as e:  # the first failed rank's own error, on every rank; the message names the key
        first = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return f"{path} does not load ({type(e).__name__}: {first[:160]})"
    if load_optim:
        state.install(opt, install)
    if rng_file is not None:  # after the last collective of this load: a refusal here is agreed in load_checkpoint
        set_rng_state(load_torch_file(os.path.join(path, rng_file), cfg.checkpoint.trust_pickle))
    return None


def _refusal_or_problem(load_format, *args) -> tuple[Optional[str], Optional[str]]:
    """(why a file was refused as more than data, why the checkpoint does not load): one of them or neither."""
    try:
        return None, load_format(*args)
    except UntrustedCheckpointError as e:
        return str(e), None


def _stage_notices(meta: dict, cfg: Config, topo: Topology) -> None:
    """What a new stage changed, logged once; ``checkpoint.finetune`` restarts iteration, data position and
    schedule (the returned meta says 0)."""
    c = cfg.checkpoint
    said = []
    saved = {k: meta[k] for k in ("tp", "cp", "dp")}
    now = {"tp": topo.tp, "cp": topo.cp, "dp": topo.dp}
    if saved != now:
        said.append("saved at " + ", ".join(f"{k}={v}" for k, v in saved.items()) + "; resharded to "
                    + ", ".join(f"{k}={v}" for k, v in now.items()))
    if not meta.get("optimizer", True):
        said.append("no optimizer state in the checkpoint: AdamW starts afresh")
    elif c.no_load_optim or c.finetune:
        said.append("optimizer state not loaded (checkpoint.no_load_optim / finetune)")
    if c.finetune:
        said.append(f"checkpoint.finetune: iteration {meta['iteration']} -> 0, the data position and the schedule "
                    f"start again")
        meta["iteration"] = meta["consumed_samples"] = meta["skipped_in_a_row"] = meta["skipped_steps"] = 0
    if said and leads(topo):
        log.info("checkpoint %s: %s", meta["path"], "; ".join(said))


def load_checkpoint(cfg: Config, topo: Topology, model, opt) -> Optional[dict]:
    """Resume from ``cfg.checkpoint.load`` (see module doc); returns the loaded checkpoint's meta, or None for a
    fresh start. Every rank must call this (ranks agree on which checkpoint loaded). ``opt`` None: the weights only
    (evaluation, export), at any layout."""
    load, save = cfg.checkpoint.load, cfg.checkpoint.save
    if not load:
        return None
    auto_resume = same_dir(load, save)
    if not os.path.exists(load) and not auto_resume:
        raise ConfigError(f"checkpoint.load ({load}) does not exist")
    if os.path.isdir(load) and is_hf_model_dir(load):
        raise ConfigError(f"checkpoint.load ({load}) is a Hugging Face model directory, not a megatron_lc "
                          f"checkpoint; import it first: python tools/convert_from_hf.py {load} OUT_DIR")
    candidates = checkpoints_newest_first(load) if os.path.isdir(load) else []
    if not candidates:
        if auto_resume:
            log.info("no checkpoint in %s yet: starting from scratch", load)
            return None
        raise ConfigError(f"checkpoint.load ({load}) holds no megatron_lc checkpoint (no iter_*/meta.json)")
    if leads(topo):
        for left in unfinished_saves(load):
            log.info("%s: a save that did not finish, ignored (the next save removes it)", left)
    failed = []
    for path in candidates:
        meta, problem = _read_meta(path)
        problems = [p for p in all_gather_objects(problem) if p is not None]
        if not problems:
            check_compatible(meta, cfg, topo, path, uses_zero(opt), opt is not None)
            load_format = _load_dcp if meta.get("format_version", 1) >= 3 else _load_torch_files_per_tp
            outcomes = all_gather_objects(_refusal_or_problem(load_format, path, meta, cfg, topo, model, opt))
            refused = [r for r, _ in outcomes if r is not None]
            if refused:  # a file that is more than data: every rank stops, whatever the other checkpoints hold
                raise UntrustedCheckpointError(refused[0])
            problems = [p for _, p in outcomes if p is not None]
        if not problems:
            if failed:
                log.warning("resumed from %s, an older checkpoint, because %s", path,
                            "; ".join(why for _, why in failed))
                _set_aside(failed, cfg, topo)
            meta["path"] = path
            _stage_notices(meta, cfg, topo)
            return meta
        failed.append((path, problems[0]))
        if not cfg.checkpoint.load_fallback:
            raise ConfigError(f"cannot resume: {problems[0]} (checkpoint.load_fallback: true resumes from the newest "
                              f"older checkpoint that loads)")
    raise ConfigError(f"cannot resume: no checkpoint in {load} loads ({'; '.join(why for _, why in failed)})")


def _read_meta(path: str) -> tuple[Optional[dict], Optional[str]]:
    try:
        return read_meta(path), None
    except ConfigError as e:
        return None, str(e)


def _set_aside(failed: list, cfg: Config, topo: Topology) -> None:
    """Rename the newer checkpoints that did not load (rank 0, when this run saves into their directory: a later
    save of the same iteration would replace them), said in the log."""
    if leads(topo) and same_dir(cfg.checkpoint.load, cfg.checkpoint.save):
        for path, _ in failed:
            log.warning("set aside %s as %s: it does not load (kept for inspection; delete it when done)", path,
                        set_aside(path))
