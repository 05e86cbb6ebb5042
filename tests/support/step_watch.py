"""A dispatch mode over a step that records what masks as ranges forbid: a tensor with two dimensions both above a
bound (a query length and a key length: a dense mask, a bias, a score matrix) and a read of a device value
(``bool()``, ``.item()``, ``if tensor``: ``aten._local_scalar_dense`` / ``aten.is_nonzero``; a host sync on a GPU).

    with StepWatch(bound=64) as watch:
        loss = model(...); loss.backward()
    assert not watch.big and not watch.reads

Run it with every other dimension of the model at or below the bound (hidden size, heads x head dim, ffn, vocab)
and the sequence well above it, so the only way to produce two dimensions above it is a [queries, keys] tensor."""
from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if "megatron_lc" in f.filename]
    return f"{frames[-1].filename.split('megatron_lc/')[-1]}:{frames[-1].lineno}" if frames else "?"


class StepWatch(TorchDispatchMode):
    def __init__(self, bound: int):
        super().__init__()
        self.bound = bound
        self.big: list = []  # (op, shape, site)
        self.reads: list = []  # (op, site)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.reads.append((str(func), _site()))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and sum(n > self.bound for n in t.shape) >= 2:
                self.big.append((str(func), tuple(t.shape), _site()))
        return out
