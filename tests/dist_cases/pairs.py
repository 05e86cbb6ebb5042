"""Feature combinations for tests/config/test_feature_pairs.py: each case trains 2 steps of a small Llama through the
real
setup and loop (``Trainer``) or is refused by ``resolve_layout`` before anything is built.

Every case runs on the same world (4 ranks; 8 for tp x hybrid) with the same global batch (4 samples), data (mock,
seeded) and init, so each must give the plain single-process model's losses; dp fills the ranks the features leave
(e.g. tp=2 x ring cp=2 is dp=1, MsT alone is dp=4). Run in few processes: one spawn per world size, each rank loops
over the cases, topologies cached by (tp, cp, ulysses)."""
from __future__ import annotations

import datetime
import itertools
import os
import tempfile
import traceback

import torch
import torch.distributed as dist

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer

GLOBAL_BATCH = 4
STEPS = 2
MODEL = ["model.num_layers=3", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=2",
         "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
         "data.seq_length=64", "data.mock_data=true", "train.device=cpu", f"train.train_iters={STEPS}",
         f"train.global_batch_size={GLOBAL_BATCH}", "train.lr=1e-3", "train.lr_warmup_iters=0",
         "logging.log_interval=100", "checkpoint.save=null"]

# name -> (the config key a refusal must name, overrides). Memo's three layers: layer 0 goes through the host.
FEATURES = {
    "tp2": ("parallel.tensor_model_parallel_size", ["parallel.tensor_model_parallel_size=2"]),
    "tp2+sp": ("parallel.sequence_parallel", ["parallel.tensor_model_parallel_size=2",
                                              "parallel.sequence_parallel=true"]),
    "ring": ("parallel.cp_comm_type", ["parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"]),
    "ulysses": ("parallel.cp_comm_type", ["parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"]),
    "hybrid": ("parallel.cp_comm_type", ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p",
                                         "parallel.ulysses_size=2"]),
    "fpdt": ("parallel.cp_comm_type", ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                                       "memory.fpdt_chunk_size=32", "memory.fpdt_offload=false"]),
    "fpdt+offload": ("parallel.cp_comm_type", ["parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                                               "memory.fpdt_chunk_size=32", "memory.fpdt_offload=true"]),
    "mst": ("memory.mst", ["memory.mst=true", "memory.mst_mlp_chunk_size=8", "memory.mst_head_chunks=4"]),
    "selective": ("memory.recompute_granularity", ["memory.recompute_granularity=selective"]),
    "full": ("memory.recompute_granularity", ["memory.recompute_granularity=full"]),
    "memo": ("memory.activation_offload", ["memory.activation_offload=memo", "memory.offload_fraction=0.25"]),
    "memo-auto": ("memory.activation_offload", ["memory.activation_offload=memo", "memory.offload_fraction=auto"]),
    "plan": ("memory.plan", ["memory.plan=auto", "memory.plan_time_limit=1"]),
    "zero1": ("parallel.use_distributed_optimizer", ["parallel.use_distributed_optimizer=true"]),
    "fsdp": ("parallel.use_torch_fsdp2", ["parallel.use_torch_fsdp2=true"]),
    "ckpt-offload": ("memory.activation_offload", ["memory.activation_offload=checkpoints"]),
    "chunks": ("memory.layer_chunk_size", ["memory.recompute_granularity=full", "memory.layer_chunk_size=20"]),
    "ckpt-chunks": ("memory.layer_chunk_size", ["memory.activation_offload=checkpoints", "memory.layer_chunk_size=20"]),
    # segments of 2 of the 3 layers: {0, 1} re-made from layer 0's input, {2} from its own (k not dividing L)
    "ckpt-segments": ("memory.checkpoint_every", ["memory.activation_offload=checkpoints",
                                                  "memory.checkpoint_every=2"]),
    "accum": ("train.micro_batch_size", ["train.micro_batch_size=1"]),  # every rank: several micro-batches
    # a causal sliding window below a ring chunk at cp 2 (32 tokens) and above one at cp 4 (16), on layers 0 and 2
    "window": ("model.sliding_window", ["model.sliding_window=20",
                                        "model.layer_types=sliding_attention,full_attention,sliding_attention"]),
    # every switch of the Hugging Face families at once (model:, megatron_lc/hf/families.py): a QKV bias, q/k norms,
    # Gemma's (1 + w) norms before and after attention and MLP, GeGLU, the scaled embedding, a query scale, and
    # with the window its layers' own RoPE base
    "arch": ("model.qk_layernorm", ["model.add_qkv_bias=true", "model.qk_layernorm=true",
                                    "model.apply_layernorm_1p=true", "model.post_self_attn_layernorm=true",
                                    "model.post_mlp_layernorm=true", "model.swiglu=false",
                                    "model.gated_linear_unit=true", "model.scale_embeddings=true",
                                    "model.softmax_scale=0.2", "model.rope_local_base_freq=1000"]),
    # the ring's zigzag layout instead of the balanced one (with documents: only in the triples below)
    "zigzag": ("parallel.cp_layout", ["parallel.cp_layout=zigzag"]),
    # mock packed documents (only in the triples below)
    "docs": ("data.reset_attention_mask", ["data.reset_position_ids=true", "data.reset_attention_mask=true",
                                           "data.eod_mask_loss=true", "data.mean_document_length=24"]),
}
# features that change the model's function: a case is compared with the plain model that has them too
BASES = ("window", "docs", "arch")
EXCLUSIVE = [{"tp2", "tp2+sp"}, {"ring", "ulysses", "hybrid", "fpdt", "fpdt+offload"},
             {"memo", "memo-auto", "ckpt-offload", "ckpt-chunks"}, {"chunks", "ckpt-offload", "ckpt-chunks"},
             {"chunks", "full", "selective"},  # chunks sets recompute full
             {"ckpt-chunks", "full", "selective"},  # checkpoints with recompute: ckpt-offload's refusals
             {"memo", "memo-auto", "ckpt-offload", "ckpt-segments"}, {"chunks", "ckpt-segments"},
             {"ckpt-segments", "full", "selective"}]
# what users run together beyond pairs
TRIPLES = [("tp2+sp", "ring", "mst", "memo"), ("tp2", "ulysses", "mst", "memo-auto"),
           ("tp2+sp", "fpdt+offload", "mst", "full"), ("hybrid", "mst", "memo", "plan"),
           ("tp2+sp", "hybrid", "mst", "full"), ("ring", "mst", "memo", "zero1", "accum"),
           ("tp2+sp", "ring", "mst", "memo", "fsdp", "accum"), ("fpdt+offload", "mst", "full", "fsdp"),
           ("tp2+sp", "ring", "mst", "ckpt-offload", "fsdp", "accum"), ("tp2+sp", "ring", "mst", "memo", "chunks"),
           ("tp2+sp", "fpdt+offload", "mst", "ckpt-chunks", "ckpt-segments", "fsdp")]


TRIPLES += [("docs", "window", "ring"), ("docs", "hybrid", "memo"), ("docs", "window", "fpdt+offload", "full"),
            ("docs", "tp2+sp", "ulysses", "mst"), ("docs", "ckpt-chunks", "ring"),
            ("docs", "window", "fpdt+offload", "ckpt-chunks", "ckpt-segments")]
# the balanced ring layout (the default) with documents under the sharded states and the memory techniques; the zigzag
TRIPLES += [("docs", "ring", "fsdp", "mst"), ("docs", "tp2+sp", "ring", "memo", "zero1"),
            ("docs", "ring", "ckpt-offload", "accum"), ("docs", "window", "hybrid", "mst", "fsdp"),
            ("docs", "ring", "zigzag"), ("docs", "window", "hybrid", "zigzag")]
TRIPLES += [("arch", "window", "docs", "hybrid"), ("arch", "tp2+sp", "ring", "mst", "memo"),
            ("arch", "window", "fpdt+offload", "fsdp")]


def cases() -> list[tuple]:
    """Every compatible pair of features (documents only in the triples), then the triples (tuples of names)."""
    pairs = [p for p in itertools.combinations(FEATURES, 2)
             if "docs" not in p and "zigzag" not in p and not any(set(p) <= g for g in EXCLUSIVE)]
    return pairs + TRIPLES


def base_of(case: tuple) -> tuple:
    """The features of ``case`` the plain reference model has too (``BASES``)."""
    return tuple(sorted(set(case) & set(BASES)))


def overrides(case: tuple) -> list[str]:
    """The case's overrides; micro_batch_size fills the global batch on each dp rank unless ``accum`` is in it."""
    out = []
    for name in case:
        out += FEATURES[name][1]
    if "accum" not in case:
        tp = cp = 1
        for o in out:
            key, value = o.split("=")
            tp = int(value) if key == "parallel.tensor_model_parallel_size" else tp
            cp = int(value) if key == "parallel.context_parallel_size" else cp
        out.append(f"train.micro_batch_size={GLOBAL_BATCH * tp * cp // world_for(case)}")
    return out


def world_for(case: tuple) -> int:
    return 8 if {"hybrid"} <= set(case) and ({"tp2", "tp2+sp"} & set(case)) else 4


def _config(case_overrides: list[str], metrics_file: str):
    return load_config(None, MODEL + case_overrides + [f"logging.metrics_file={metrics_file}"])


def reference_losses(base: tuple = ()) -> list[float]:
    """The plain single-process model (with the ``base`` features: ``BASES``) on the same global batch."""
    with tempfile.TemporaryDirectory() as tmp:
        over = [o for name in base for o in FEATURES[name][1]]
        cfg = _config(over + [f"train.micro_batch_size={GLOBAL_BATCH}"], os.path.join(tmp, "m.jsonl"))
        return Trainer(cfg, Topology()).train().losses


def run_case(case: tuple, world: int, topos: dict, tmp: str) -> dict:
    """{"losses": [...]} | {"refused": message} | {"error": traceback} for one case on this rank."""
    try:
        cfg = _config(overrides(case), os.path.join(tmp, f"{'-'.join(case)}.jsonl"))
        layout = resolve_layout(cfg, world)
    except ConfigError as e:
        return {"refused": str(e)}
    try:
        key = (layout.tp, layout.cp, layout.ulysses)
        if key not in topos:  # 2 min: a rank that diverged fails the case instead of hanging the suite
            topos[key] = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses,
                                        timeout=datetime.timedelta(minutes=2))
        return {"losses": Trainer(cfg, topos[key], layout=layout).train().losses}
    except Exception:  # noqa: BLE001 - reported per case by the test
        return {"error": traceback.format_exc(limit=12)}


def train_losses(rank: int, world: int, config: list) -> list[float]:
    """Losses of ``config`` (full overrides) trained on ``world`` ranks (1: in this process)."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, list(config) + [f"logging.metrics_file={os.path.join(tmp, 'm.jsonl')}"])
        layout = resolve_layout(cfg, world)
        topo = Topology.build(tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses)
        return Trainer(cfg, topo, layout=layout).train().losses


def run_cases(rank: int, world: int, names: list) -> dict:
    torch.set_num_threads(1)
    topos: dict = {}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in names:
            out[case] = run_case(tuple(case), world, topos, tmp)
            dist.barrier()
    return out
