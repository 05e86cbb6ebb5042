"""Rank function for tests/parallel/test_collectives_device.py: every torch.distributed call of one training step,
recorded
with the devices of the tensors it carries and the file that issued it."""
from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.dist_cases.train import TINY

PKG = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "megatron_lc")
TENSOR_CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                "broadcast", "batch_isend_irecv")  # (isend / irecv are not wrapped: P2POp checks their identity)


def _tensors(name, args, kwargs):
    if name == "batch_isend_irecv":
        return [op.tensor for op in args[0]]
    found = [a for a in args if torch.is_tensor(a)] + [v for v in kwargs.values() if torch.is_tensor(v)]
    for a in args:
        if isinstance(a, (list, tuple)):
            found += [x for x in a if torch.is_tensor(x)]
    return found


def record_step(rank, world, overrides):
    """Calls of one step (after setup): ``[(function, issuing file, devices)]``; the file relative to the package,
    or ``torch:<file>`` for a call torch makes itself (ZeRO-1's broadcasts)."""
    cfg = load_config(None, TINY + ["train.train_iters=1"] + list(overrides))
    layout = resolve_layout(cfg, world)
    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    trainer = Trainer(cfg, topo, layout=layout)
    calls = []
    originals = {n: getattr(dist, n) for n in TENSOR_CALLS}

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            caller = traceback.extract_stack()[-2].filename  # who called torch.distributed
            site = (os.path.relpath(caller, PKG) if caller.startswith(PKG) else
                    "torch:" + os.path.basename(caller))
            calls.append((name, site, sorted({t.device.type for t in _tensors(name, args, kwargs)})))
            return fn(*args, **kwargs)
        return recorded

    for n, fn in originals.items():
        setattr(dist, n, wrap(n, fn))
    try:
        trainer.train_step(0)
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return calls, str(trainer.device)
