"""Checkpoints across tensor-parallel degrees: the tp shards of a checkpoint merged into full tensors and cut again
for this run's tp. Model weights always; plain AdamW states (``exp_avg``, ``exp_avg_sq`` have their parameter's
shape and partition) too; ZeRO-1 optimizer shards only at the layout they were saved for.

Example, a checkpoint saved at tp=2 resumed at tp=1: ``model_tp00.pt`` and ``model_tp01.pt`` hold the two halves of
``layers.0.mlp.linear_fc1.weight`` (partition ``(0, 2)``: each rank holds its half of gate and of up); merged, the
full ``[gate; up]`` is the tp=1 parameter. Shard files are memory-mapped, so a rank reads only what it keeps.
"""
from __future__ import annotations

import copy
import os
from typing import Optional

import torch

from ...config import Config, ParallelConfig, resolve_layout
from ...model.transformer import GPTModel
from ...compose import ModelParts
from ...parallel.tensor_parallel import cut_shard, merge_shards, tp_partition
from ...parallel.topology import Topology
from .data_only import load_torch_file


def _meta_model(cfg: Config, tp: int) -> GPTModel:
    """``cfg``'s plain model at ``tp`` on the meta device (the layout has one source: the model code)."""
    plain = copy.deepcopy(cfg)  # only tp shapes the parameters; cp, SP and memory features do not
    plain.parallel = ParallelConfig(tensor_model_parallel_size=tp)
    topo = Topology(world_size=tp, rank=0, tp=tp)
    with torch.device("meta"):  # the default spec: the plain model's classes
        return GPTModel(plain.model, ModelParts(plain, resolve_layout(plain, tp), topo))


def partitions(cfg: Config, tp: int) -> dict:
    """``{parameter name: (dim, stride) or None}`` of ``cfg``'s model at ``tp``, in ``named_parameters`` order."""
    return {n: tp_partition(p) for n, p in _meta_model(cfg, tp).named_parameters()}


def parameter_shapes(cfg: Config) -> dict:
    """``{parameter name: (full shape, partition)}`` of ``cfg``'s model."""
    return {n: (tuple(p.shape), tp_partition(p)) for n, p in _meta_model(cfg, 1).named_parameters()}


def _load(path: str, cfg: Config) -> dict:
    return load_torch_file(path, cfg.checkpoint.trust_pickle, mmap=True)


def merged_model_state(path: str, cfg: Config, tp: int) -> dict:
    """The full (unsharded) model state of checkpoint directory ``path`` saved at ``tp``."""
    shards = [_load(os.path.join(path, f"model_tp{r:02d}.pt"), cfg) for r in range(tp)]
    parts = partitions(cfg, tp)
    unknown = sorted(set(shards[0]) - set(parts))
    if unknown:
        raise ValueError(f"checkpoint keys not in the model: {unknown[:5]}")
    return {name: merge_shards([s[name] for s in shards], parts[name]) for name in shards[0]}


def model_state_for(path: str, cfg: Config, saved_tp: int, topo: Topology) -> dict:
    """This tp rank's model state from a checkpoint saved at ``saved_tp`` (any tp)."""
    if saved_tp == topo.tp:
        return _load(os.path.join(path, f"model_tp{topo.tp_rank:02d}.pt"), cfg)
    parts = partitions(cfg, topo.tp)
    full = merged_model_state(path, cfg, saved_tp)
    return {n: cut_shard(t, parts.get(n), topo.tp, topo.tp_rank).clone() for n, t in full.items()}


def optimizer_state_for(path: str, cfg: Config, saved_tp: int, topo: Topology, names: list[str]) -> dict:
    """This tp rank's plain-AdamW state dict from a checkpoint saved at ``saved_tp``. ``names``: the parameter names
    in the optimizer's index order (the order of its param groups)."""
    if saved_tp == topo.tp:
        return _load(os.path.join(path, f"optim_tp{topo.tp_rank:02d}.pt"), cfg)
    saved = [_load(os.path.join(path, f"optim_tp{r:02d}.pt"), cfg) for r in range(saved_tp)]
    old_parts, new_parts = partitions(cfg, saved_tp), partitions(cfg, topo.tp)
    out = copy.deepcopy(saved[0])
    for idx, st in out["state"].items():
        name = names[idx]
        for key, value in st.items():
            if torch.is_tensor(value) and value.dim() > 0:  # moments: merged like the parameter, then cut
                full = merge_shards([s["state"][idx][key] for s in saved], old_parts[name])
                st[key] = cut_shard(full, new_parts[name], topo.tp, topo.tp_rank).clone()
    return out


def check_tp_change(meta: dict, topo: Topology, zero: bool, load_optim: bool) -> Optional[str]:
    """Why this checkpoint cannot be resumed at this layout (ZeRO-1 shards of another dp x cp or tp), or None."""
    if not load_optim or not meta.get("optimizer", True):
        return None
    if meta["zero"] and (not zero or meta["tp"] != topo.tp or meta["dp"] * meta["cp"] != topo.dp * topo.cp):
        return (f"holds ZeRO-1 optimizer shards for tp={meta['tp']}, dp*cp={meta['dp'] * meta['cp']}; this run has "
                f"tp={topo.tp}, dp*cp={topo.dp * topo.cp} {'with' if zero else 'without'} ZeRO-1 (ZeRO-1 states are "
                f"resumed at their own layout only; checkpoint.no_load_optim starts the optimizer afresh)")
    if zero and not meta["zero"]:
        return ("holds plain AdamW states and this run uses ZeRO-1 (use_distributed_optimizer); "
                "checkpoint.no_load_optim starts the optimizer afresh")
    return None
