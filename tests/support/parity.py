"""Helpers for parity tests: a small config, the reference single-process model, gathering full grads.

Tolerances (fp32 on CPU): the contract is loss within 1e-5 relative and gradients within 1e-4. Parallel layouts
change only the order of floating-point reductions (sums split over ranks, softmax merged by lse), each step of
which has relative error ~1e-7 (fp32 epsilon 6e-8 times a few); over a few layers and sums of at most thousands of
terms the accumulated error stays ~1e-6 relative, an order of magnitude inside the contract."""
from __future__ import annotations

import torch

from megatron_lc.compose import ModelParts, model_context
from megatron_lc.config import Config, load_config, resolve_execution, resolve_layout
from megatron_lc.parallel.tensor_parallel import merge_shards
from megatron_lc.parallel.topology import Axis, Topology
from megatron_lc.training.setup import build_and_calibrate

LOSS_RTOL = 1e-5
GRAD_ATOL = 1e-4
CPU = torch.device("cpu")


def small_config(overrides=()) -> Config:
    base = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
            "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
            "data.seq_length=32", "data.mock_data=true", "train.micro_batch_size=2", "train.device=cpu"]
    return load_config(None, base + list(overrides))


def build(cfg: Config, topo: Topology = None, adjust_spec=None):
    """(model, context) of ``cfg`` for ``topo`` (default: one process) on the CPU, Memo calibrated: the layout and
    steps 3-5 of ``training/setup.py``."""
    topo = topo if topo is not None else Topology()
    return build_and_calibrate(cfg, resolve_layout(cfg, topo.world_size), topo, resolve_execution(cfg, CPU),
                               adjust_spec)


def block_parts(cfg: Config, topo: Topology = None) -> ModelParts:
    """``ModelParts`` to construct single blocks of ``cfg`` outside a model (its layout, a fresh context)."""
    topo = topo if topo is not None else Topology()
    layout = resolve_layout(cfg, topo.world_size)
    return ModelParts(cfg, layout, topo, ctx=model_context(cfg, layout))


def batch_for(cfg: Config, seed: int = 0, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    s = cfg.data.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, s + 1), generator=g)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(s).expand(batch, s).contiguous(), "loss_mask": torch.ones(batch, s)}


def full_grads(model, topo: Topology) -> dict:
    """Gradients of the full model (tp shards merged), keyed by parameter name."""
    import torch.distributed as dist

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if getattr(p, "tensor_model_parallel", False) and topo.tp > 1:
            parts = [torch.empty_like(g) for _ in range(topo.tp)]
            dist.all_gather(parts, g.contiguous(), group=topo.group(Axis.TP))
            g = merge_shards(parts, p.partition)
        out[name] = g
    return out


def assert_close_grads(got: dict, ref: dict, atol: float = GRAD_ATOL) -> None:
    assert got.keys() == ref.keys(), (sorted(got) , sorted(ref))
    for k in ref:
        err = (got[k] - ref[k]).abs().max().item()
        assert err <= atol, f"grad {k}: max abs diff {err:.3e} > {atol}"


def assert_close_loss(got: float, ref: float, rtol: float = LOSS_RTOL) -> None:
    assert abs(got - ref) <= rtol * abs(ref), f"loss {got!r} vs reference {ref!r}: rel diff {abs(got - ref) / abs(ref):.3e}"


def plain_config(cfg: Config) -> Config:
    """A copy of ``cfg`` as the plain single-process model: tp = cp = 1, no memory technique (the references the
    parity cases compare against)."""
    import copy

    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.parallel.tensor_model_parallel_size = ref_cfg.parallel.context_parallel_size = 1
    ref_cfg.parallel.ulysses_size, ref_cfg.parallel.cp_comm_type, ref_cfg.parallel.cp_layout = 1, "p2p", "auto"
    ref_cfg.parallel.sequence_parallel = False
    for k, v in {"mst": False, "recompute_granularity": "none", "activation_offload": "none", "plan": "off",
                 "layer_chunk_size": None, "checkpoint_every": 1}.items():
        setattr(ref_cfg.memory, k, v)
    return ref_cfg


def reference_loss_and_grads(cfg: Config, batch: dict):
    """The plain single-process model (tp=cp=1, no memory features) on the full batch: mean token loss, grads."""
    ref_cfg = plain_config(cfg)
    model, _ = build(ref_cfg)
    tok_loss = model(batch["tokens"], batch["position_ids"], batch["labels"])
    loss = (tok_loss * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss.backward()
    return float(loss.detach()), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def sharded_loss(cfg: Config, layout, batch: dict, total: float):
    """The model under ``cfg``'s ``layout`` on this rank's shard of ``batch`` (documents too), forward and backward,
    its gradients synced: (the loss of every rank's tokens over ``total``, all-reduced over cp; the model; its
    topology)."""
    from megatron_lc.parallel.collectives import all_reduce
    from megatron_lc.parallel.token_layout import shard_batch
    from megatron_lc.training.optimizer import sync_gradients

    topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
    model, _ = build(cfg, topo)
    local = shard_batch(batch, layout, topo)
    tok = model(local["tokens"], local["position_ids"], local["labels"], local.get("documents"))
    loss = (tok * local["loss_mask"]).sum() / total
    loss.backward()
    sync_gradients(model, topo)
    got = loss.detach().clone()
    all_reduce(got, topo, Axis.CP)
    return float(got), model, topo
