"""Rank functions of ``test_ranks_one_gpu.py`` (run under ``tests.support.dist.run_dist``: gloo, one process per rank;
the
model and every collective's tensors on ``cuda:0`` where there is a GPU, on the CPU in the dry run)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_lc.config import resolve_execution, resolve_layout
from megatron_lc.parallel.collectives import all_reduce
from megatron_lc.parallel.token_layout import shard_batch
from megatron_lc.parallel.topology import Axis, Topology
from megatron_lc.training.optimizer import sync_gradients
from megatron_lc.training.setup import build_and_calibrate
from tests.support.parity import batch_for, full_grads, small_config

WAIT = datetime.timedelta(seconds=60)


def on_device(kind: str) -> torch.device:
    if kind == "cuda":
        torch.cuda.set_device(0)  # every rank on the one GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", 0)
    return torch.device("cpu")


def probe(rank: int, world: int, op: str, kind: str) -> str:
    """Whether gloo takes ``kind`` tensors for ``op``: 'ok' or the error (values checked)."""
    device = on_device(kind)
    t = torch.full((4,), float(rank + 1), device=device)
    if op == "all_reduce":
        dist.all_reduce(t, async_op=True).wait(WAIT)
        want = torch.full((4,), float(world * (world + 1) // 2), device=device)
    elif op == "all_gather":
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t, async_op=True).wait(WAIT)
        t, want = torch.cat(parts), torch.cat([torch.full((4,), float(r + 1), device=device) for r in range(world)])
    elif op == "all_to_all":
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, async_op=True).wait(WAIT)
        t, want = out, torch.cat([torch.full((4 // world,), float(r + 1), device=device) for r in range(world)])
    else:  # p2p, as the ring posts it
        buf = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, (rank + 1) % world), dist.P2POp(dist.irecv, buf, (rank - 1) % world)]
        for w in dist.batch_isend_irecv(ops):
            w.wait(WAIT)
        t, want = buf, torch.full((4,), float((rank - 1) % world + 1), device=device)
    return "ok" if torch.equal(t, want) else f"wrong values: {t.tolist()} != {want.tolist()}"


def loss_and_grads(rank: int, world: int, overrides: list, kind: str):
    """The small model of ``overrides`` on ``world`` ranks: the global loss and (rank 0) every full gradient."""
    device = on_device(kind)
    cfg = small_config(list(overrides))
    layout, p = resolve_layout(cfg, world), cfg.parallel
    topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size)
    model, _ = build_and_calibrate(cfg, layout, topo, resolve_execution(cfg, device))
    batch = batch_for(cfg)
    local = {k: v.to(device) for k, v in shard_batch(batch, layout, topo).items()}
    tok = model(local["tokens"], local["position_ids"], local["labels"])
    loss = (tok * local["loss_mask"]).sum() / batch["loss_mask"].sum().item()
    loss.backward()
    sync_gradients(model, topo)
    total = loss.detach().double()
    all_reduce(total, topo, Axis.CP)  # each cp rank holds its tokens' share of the loss
    grads = full_grads(model, topo)
    return float(total), ({k: g.cpu() for k, g in grads.items()} if rank == 0 else None)
