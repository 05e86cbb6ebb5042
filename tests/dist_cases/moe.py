"""Rank functions and cases for tests/parallel/test_expert_parallel.py: the tiny Qwen3-MoE, Qwen2-MoE and Mixtral
(their ``model:`` sections as the importer writes them from transformers' config classes) under expert parallelism
with every context-parallel layout and memory technique, trained through the real setup and loop
(``families.train_cases``); and the MoE block alone on a batch whose every token routes to one expert."""
from __future__ import annotations

import tempfile

import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.hf import model_section_from_hf
from megatron_lc.model.init import init_model
from megatron_lc.model.moe import MoE
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.optimizer import sync_gradients
from tests.dist_cases.families import LAYOUTS, TECHNIQUES
from tests.dist_cases.fsdp import full_grad
from tests.support.hf_families import ARCHITECTURES, moe_family_configs
from tests.support.parity import block_parts

DOCS = ["data.reset_position_ids=true", "data.reset_attention_mask=true", "data.eod_mask_loss=true",
        "data.mean_document_length=12"]


def section(name: str, **changes) -> dict:
    """The ``model:`` section the importer writes for the tiny model of MoE family ``name``."""
    import transformers

    cls, kwargs = moe_family_configs(transformers)[name]
    return model_section_from_hf({**cls(**{**kwargs, **changes}).to_dict(), "architectures": [ARCHITECTURES[name]]})


def ep(n: int) -> list:
    return [f"parallel.expert_model_parallel_size={n}"]


# world 2, ep 2 over the dp or cp pair
EP2 = {
    "dp2": ep(2) + ["train.micro_batch_size=1"],
    "ring": ep(2) + LAYOUTS["ring"],
    "ulysses": ep(2) + LAYOUTS["ulysses"],
    "fpdt": ep(2) + LAYOUTS["fpdt"],
    "fsdp2": ep(2) + LAYOUTS["fsdp2"],
    "mst": ep(2) + ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "train.micro_batch_size=1"],
    "recompute+mst": ep(2) + ["memory.recompute_granularity=full", "memory.mst=true", "memory.mst_mlp_chunk_size=8",
                              "train.micro_batch_size=1"],
    "ring+host-checkpoints": ep(2) + TECHNIQUES["ring+host-checkpoints"],
    "ring+documents": ep(2) + LAYOUTS["ring"] + DOCS,
}
# Memo's offload without expert parallelism (its rounding buffers hold a layer's rows; under ep the rows a rank
# receives change every step: refused, config/combinations.py)
EP1 = {"memo+mst": TECHNIQUES["memo+mst"]}
# world 4: ep 2 beside tp 2 + SP (dp 2); ep 4 over dp 2 x cp 2
EP4 = {
    "ep2/tp2+sp": ep(2) + LAYOUTS["tp2+sp"][:2] + ["train.micro_batch_size=1"],
    "ep4/ring": ep(4) + LAYOUTS["ring"][:2] + ["train.micro_batch_size=1"],
    "ep4/ulysses": ep(4) + LAYOUTS["ulysses"][:3] + ["train.micro_batch_size=1"],
    "ep4/fpdt": ep(4) + LAYOUTS["fpdt"][:4] + ["train.micro_batch_size=1"],
    "ep4/fsdp2": ep(4) + ["parallel.use_torch_fsdp2=true", "parallel.context_parallel_size=2",
                          "train.micro_batch_size=1"],
    "ep4/ring+mst": ep(4) + LAYOUTS["ring"][:2] + ["memory.mst=true", "memory.mst_mlp_chunk_size=8",
                                                    "train.micro_batch_size=1"],
    "ep4/ring+recompute": ep(4) + LAYOUTS["ring"][:2] + ["memory.recompute_granularity=full",
                                                          "train.micro_batch_size=1"],
    "ep4/ring+host-checkpoints": ep(4) + LAYOUTS["ring"][:2] + ["memory.activation_offload=checkpoints",
                                                                 "train.micro_batch_size=1"],
    "ep4/ring+documents": ep(4) + LAYOUTS["ring"][:2] + DOCS + ["train.micro_batch_size=1"],
    "ep4/hybrid": ep(4) + ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p",
                           "parallel.ulysses_size=2", "train.micro_batch_size=2"],
}


# ---- one expert takes every token ------------------------------------------------------------------------------
ONE_EXPERT = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=64",
              "model.make_vocab_size_divisible_by=64", "model.num_moe_experts=4", "model.moe_router_topk=2",
              "model.moe_ffn_hidden_size=32", "model.moe_aux_loss_coeff=0.1", "model.moe_z_loss_coeff=0.01",
              "data.seq_length=16", "data.mock_data=true", "train.device=cpu"]


def one_expert_block(rank: int, world: int, ep_size: int, tokens: int = 24) -> dict:
    """The MoE block of ``ONE_EXPERT`` under expert parallelism ``ep_size`` over ``world`` dp ranks (1: the whole
    batch in one process), its router set so that expert 0 is in every token's top-2 (positive inputs, expert 0's
    router row positive, the others' negative): forward and backward of this rank's ``tokens / world`` rows, the
    routers' totals finished over the ranks. Returns the output rows and the full gradients."""
    torch.manual_seed(0)
    cfg = load_config(None, ONE_EXPERT + [f"parallel.expert_model_parallel_size={ep_size}",
                                          f"train.micro_batch_size={world}"])
    topo = Topology.build(ep=ep_size) if world > 1 else Topology()
    parts = block_parts(cfg, topo)
    layout = resolve_layout(cfg, world)
    assert layout.ep == ep_size
    block = MoE(cfg.model, parts, 0.02)
    init_model(block, 0, topo)
    with torch.no_grad():
        block.router.weight.copy_(torch.tensor([1.0, -1.0, -1.2, -1.4]).unsqueeze(1).expand(4, 64) / 8)
    g = torch.Generator().manual_seed(1)
    x_all = torch.rand(tokens, 1, 64, generator=g) + 0.5  # every entry positive
    x = x_all.chunk(world)[rank].clone().requires_grad_(True)
    routing = parts.ctx.routing
    routing.begin()
    y = block(x)
    routing.finish(topo)
    (y * torch.linspace(-1, 1, 64)).sum().backward()
    sync_gradients(block, topo)  # the router's over the ranks, the experts' over their replicas (none here)
    grads = {n: full_grad(p, topo) for n, p in block.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "aux": float(routing.aux_loss()),
            "counts": routing.total[:4].tolist()}


# ---- checkpoints under expert parallelism -------------------------------------------------------------------------
def save_then_resume(rank: int, world: int, model: dict, saved_at: list, resumed_at: list, run: str) -> dict:
    """Step 3's loss of: 2 steps under ``saved_at`` saved to ``run`` then one more under ``resumed_at`` from that
    checkpoint (weights and AdamW states), and 3 steps under ``saved_at`` in one go."""
    from tests.dist_cases.families import _trainer

    torch.set_num_threads(1)
    topos: dict = {}
    out = {}
    saved_at, resumed_at = saved_at + ["train.lr_decay_style=constant"], resumed_at + ["train.lr_decay_style=constant"]
    with tempfile.TemporaryDirectory() as tmp:
        _trainer(model, saved_at + [f"checkpoint.save={run}"], world, topos, tmp).train()
        resumed = _trainer(model, resumed_at + ["train.train_iters=3", f"checkpoint.load={run}"], world, topos,
                           tmp).train()
        whole = _trainer(model, saved_at + ["train.train_iters=3"], world, topos, tmp).train()
    out["resumed"], out["whole"] = resumed.losses, whole.losses
    return out
