"""Calibration cases of the memory model and their rank function (run by ``tests.support.dist.run_dist`` in fresh
processes). Used by ``tests/estimate/test_estimate_calibration.py`` and ``bench/estimate_calibration.py``."""
from __future__ import annotations

import os
import tempfile
from typing import Optional

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

TIGHT = {"tolerance": 0.025}  # a case whose feature moves the peak by less than the 10% limit
BENCH = {"bench_only": True}  # measured by bench/estimate_calibration.py, not by the test (keeps it < 1-2 min)

# (id, ranks, overrides on top of base_overrides[, options]): one line per feature combination; options:
# "bench_only" (bench/estimate_calibration.py only), "xfail" (a known difference, the reason), "tolerance" (the
# case's own limit, below the test's 10%), "expert_load" (the load the case's routers give its busiest expert rank)
# vocab 256 (the layer backward sets the peak), 4K tokens, tp2 with sequence parallelism
TP2_SP_4K = ["model.vocab_size=256", "data.seq_length=4096", "parallel.tensor_model_parallel_size=2",
             "parallel.sequence_parallel=true"]
QWEN3 = ["model.qk_layernorm=true", "model.add_qkv_bias=true"]
GEMMA3 = ["model.qk_layernorm=true", "model.apply_layernorm_1p=true", "model.post_self_attn_layernorm=true",
          "model.post_mlp_layernorm=true", "model.swiglu=false", "model.gated_linear_unit=true",
          "model.scale_embeddings=true", "model.softmax_scale=0.0625"]
# a mixture of experts on the tiny model: 8 experts of 256, top-2, the load-balancing loss on; vocab 256 (the layers'
# activations set the peak)
MOE = ["model.vocab_size=256", "data.seq_length=2048", "model.num_moe_experts=8", "model.moe_router_topk=2",
       "model.moe_ffn_hidden_size=256", "model.moe_aux_loss_coeff=0.01"]
CASES = [
    ("plain", 1, []),
    ("plain-2-microbatches", 1, ["train.global_batch_size=2"], BENCH),
    ("small-vocab", 1, ["model.vocab_size=256"]),
    ("gpt-layernorm-gelu", 1, ["model.normalization=LayerNorm", "model.swiglu=false", "model.ffn_hidden_size=1024",
                               "model.add_bias_linear=true"]),
    ("tp2", 2, ["parallel.tensor_model_parallel_size=2"], BENCH),
    ("tp2-sp", 2, ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]),
    ("dp2", 2, [], BENCH),
    ("dp2-zero1", 2, ["parallel.use_distributed_optimizer=true"]),
    ("dp2-fsdp", 2, ["parallel.use_torch_fsdp2=true"]),
    ("dp2-fsdp-cpu-offload", 2, ["parallel.use_torch_fsdp2=true", "parallel.fsdp_cpu_offload=true"]),
    # FSDP2 frees each gathered layer with storage.resize_(0) and gathers into it again with resize_(n); with Memo at
    # 2048 tokens the layers' activations, not the optimizer step, set the peak (on CPU the offload's bytes are the
    # same: its device/host split exists only on a GPU)
    ("dp2-fsdp-memo", 2, ["data.seq_length=2048", "parallel.use_torch_fsdp2=true", "memory.activation_offload=memo",
                          "memory.offload_fraction=0.25"]),
    ("dp2-fsdp-cpu-offload-memo", 2, ["data.seq_length=2048", "parallel.use_torch_fsdp2=true",
                                      "parallel.fsdp_cpu_offload=true", "memory.activation_offload=memo",
                                      "memory.offload_fraction=0.25"], BENCH),
    ("tp2-sp-fsdp-ring-cp2-mst", 4, ["data.seq_length=2048", "parallel.tensor_model_parallel_size=2",
                                     "parallel.sequence_parallel=true", "parallel.context_parallel_size=2",
                                     "parallel.use_torch_fsdp2=true", "memory.mst=true"]),
    # memory features at 2048 tokens (activations, not the optimizer step, set the peak)
    ("recompute-full", 1, ["data.seq_length=2048", "memory.recompute_granularity=full"]),
    ("recompute-selective", 1, ["data.seq_length=2048", "memory.recompute_granularity=selective"], BENCH),
    ("mst", 1, ["data.seq_length=2048", "memory.mst=true"]),
    ("mst-recompute", 1, ["data.seq_length=2048", "memory.mst=true", "memory.recompute_granularity=full"], BENCH),
    ("memo-alpha0", 1, ["data.seq_length=2048", "memory.activation_offload=memo", "memory.offload_fraction=0"]),
    ("memo-alpha0.5", 1, ["data.seq_length=2048", "memory.activation_offload=memo", "memory.offload_fraction=0.5"],
     BENCH),
    ("memo-alpha1-mst", 1, ["data.seq_length=2048", "memory.activation_offload=memo", "memory.offload_fraction=1",
                            "memory.mst=true"]),
    ("ckpt-offload", 1, ["data.seq_length=2048", "memory.activation_offload=checkpoints"]),
    ("ckpt-offload-mst", 1, ["data.seq_length=2048", "memory.activation_offload=checkpoints", "memory.mst=true"]),
    # vocab 256: the layer backward (the re-run's working set), not the head, sets the peak -- the first layer's
    # backward, with every layer's gradients; then memory.layer_chunk_size, the re-run in mini-sequences of
    # 256 rows (1024: MsT's 256-token MLP chunks inside each)
    ("ckpt-offload-small-vocab", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                     "memory.activation_offload=checkpoints"]),
    ("recompute-full-small-vocab", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                       "memory.recompute_granularity=full"]),
    ("ckpt-offload-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                "memory.activation_offload=checkpoints", "memory.layer_chunk_size=256"]),
    # segments of 3 of the 4 layers ({0, 1, 2} {3}): layer 2's backward holds layer 1's re-made input
    ("ckpt-offload-every3-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                       "memory.activation_offload=checkpoints", "memory.layer_chunk_size=256",
                                       "memory.checkpoint_every=3"]),
    ("ckpt-offload-every2", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                "memory.activation_offload=checkpoints", "memory.checkpoint_every=2"], BENCH),
    ("ckpt-offload-mst-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                    "memory.activation_offload=checkpoints", "memory.mst=true",
                                    "memory.layer_chunk_size=1024"]),
    ("recompute-full-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                  "memory.recompute_granularity=full", "memory.layer_chunk_size=256"]),
    ("recompute-full-mst-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048", "memory.mst=true",
                                      "memory.recompute_granularity=full", "memory.layer_chunk_size=1024"], BENCH),
    ("memo-alpha0-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048", "memory.activation_offload=memo",
                               "memory.offload_fraction=0", "memory.layer_chunk_size=256"]),
    ("memo-alpha0.5-chunks", 1, ["model.vocab_size=256", "data.seq_length=2048", "memory.activation_offload=memo",
                                 "memory.offload_fraction=0.5", "memory.layer_chunk_size=256"], BENCH),
    ("tp2-sp-ckpt-offload-chunks", 2, TP2_SP_4K + ["memory.activation_offload=checkpoints",
                                                   "memory.layer_chunk_size=256"]),
    ("tp2-sp-recompute-full-chunks", 2, TP2_SP_4K + ["memory.recompute_granularity=full",
                                                     "memory.layer_chunk_size=256"], BENCH),
    ("ulysses-cp2-ckpt-offload-chunks", 2, ["model.vocab_size=256", "data.seq_length=4096",
                                            "parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a",
                                            "memory.activation_offload=checkpoints", "memory.layer_chunk_size=256"]),
    ("ring-cp2-memo-alpha0.25-chunks", 2, ["model.vocab_size=256", "data.seq_length=4096",
                                           "parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p",
                                           "memory.activation_offload=memo", "memory.offload_fraction=0.25",
                                           "memory.layer_chunk_size=256"]),
    # context parallel: 1024 tokens per rank, so activations (not the optimizer step) set the peak
    ("ring-cp2", 2, ["data.seq_length=2048", "parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"], BENCH),
    ("ulysses-cp2", 2, ["data.seq_length=2048", "parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"]),
    ("hybrid-cp4", 4, ["data.seq_length=2048", "parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p",
                       "parallel.ulysses_size=2"]),
    ("fpdt-cp2-u4", 2, ["data.seq_length=2048", "parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                        "memory.fpdt_chunk_size=512"]),
    ("fpdt-cp2-u4-no-offload", 2, ["data.seq_length=2048", "parallel.context_parallel_size=2",
                                   "parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=512",
                                   "memory.fpdt_offload=false"], BENCH),
    # vocab 256 and FFN 256: the attention backward (ring buffers, all-to-alls, FPDT chunk pipeline) sets the peak
    ("ring-cp2-attn-bound", 2, ["model.vocab_size=256", "model.ffn_hidden_size=256", "data.seq_length=2048",
                                "parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p"]),
    ("ulysses-cp2-attn-bound", 2, ["model.vocab_size=256", "model.ffn_hidden_size=256", "data.seq_length=2048",
                                   "parallel.context_parallel_size=2", "parallel.cp_comm_type=a2a"], BENCH),
    ("fpdt-cp2-u4-attn-bound", 2, ["model.vocab_size=256", "model.ffn_hidden_size=256", "data.seq_length=2048",
                                   "parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                                   "memory.fpdt_chunk_size=512"]),
    # FPDT's block as the chunked checkpoints mode's attention (4 chunks of 512 local rows, mini-sequences of 256)
    ("fpdt-cp2-u4-ckpt-chunks", 2, ["model.vocab_size=256", "model.ffn_hidden_size=256", "data.seq_length=4096",
                                    "parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                                    "memory.fpdt_chunk_size=1024", "memory.activation_offload=checkpoints",
                                    "memory.layer_chunk_size=256"]),
    ("fpdt-cp2-u4-ckpt-chunks-every2-mst", 2, ["model.vocab_size=256", "data.seq_length=4096",
                                               "parallel.context_parallel_size=2", "parallel.cp_comm_type=fpdt",
                                               "memory.fpdt_chunk_size=1024", "memory.activation_offload=checkpoints",
                                               "memory.layer_chunk_size=256", "memory.checkpoint_every=2",
                                               "memory.mst=true"], BENCH),
    ("tp2-sp-ulysses-cp2", 4, ["data.seq_length=2048", "parallel.tensor_model_parallel_size=2",
                               "parallel.sequence_parallel=true", "parallel.context_parallel_size=2",
                               "parallel.cp_comm_type=a2a"]),
    ("tp2-sp-zero1-mst-recompute", 2, ["data.seq_length=4096", "parallel.tensor_model_parallel_size=2",
                                       "parallel.sequence_parallel=true", "parallel.use_distributed_optimizer=true",
                                       "memory.mst=true", "memory.recompute_granularity=full"]),
    ("ulysses-cp2-memo-alpha0.25", 2, ["data.seq_length=4096", "parallel.context_parallel_size=2",
                                       "parallel.cp_comm_type=a2a", "memory.activation_offload=memo",
                                       "memory.offload_fraction=0.25"]),
    ("plan-auto", 1, ["memory.plan=auto"], BENCH),
    # the Hugging Face families' switches (model:): Qwen's q/k norms and QKV bias; Gemma 3's (1 + w) norms before and
    # after attention and MLP, GeGLU, the scaled embedding and the query scale. Vocab 256: the layers' activations
    # set the peak; measured +1.0%, +1.7%, +1.3% (recompute full +2.2%), and with the norms' saved tensors left out
    # of the estimate -3.3%, -8.6%, -5.0%: the 2.5% limit ("tolerance") tells them apart
    ("qwen3-qk-norm", 1, ["model.vocab_size=256", "data.seq_length=2048"] + QWEN3, TIGHT),
    ("qwen3-qk-norm-recompute-full", 1, ["model.vocab_size=256", "data.seq_length=2048",
                                         "memory.recompute_granularity=full"] + QWEN3, BENCH),
    ("gemma3-switches", 1, ["model.vocab_size=256", "data.seq_length=2048"] + GEMMA3, TIGHT),
    ("gemma3-switches-memo", 1, ["model.vocab_size=256", "data.seq_length=2048", "memory.activation_offload=memo",
                                 "memory.offload_fraction=0.25"] + GEMMA3, TIGHT),
    ("tp2-sp-gemma3-switches", 2, TP2_SP_4K + GEMMA3, BENCH),
    ("plan-auto-recompute", 1, ["data.seq_length=2048", "memory.plan=auto", "memory.recompute_granularity=full"]),
    ("moe", 1, MOE),
    ("moe-mst", 1, MOE + ["memory.mst=true", "memory.mst_mlp_chunk_size=256"]),
    # random tiny routers spread the copies about evenly (an expert rank's load per layer within 12% of its fair
    # share, about even summed over the layers): the estimate at that load, not the worst case it assumes for a run
    ("moe-ep2", 2, MOE + ["parallel.expert_model_parallel_size=2"], {"expert_load": 1.05}),
    ("moe-ep2-ring-cp2-mst", 2, MOE + ["data.seq_length=4096", "parallel.expert_model_parallel_size=2",
                                       "parallel.context_parallel_size=2", "memory.mst=true",
                                       "memory.mst_mlp_chunk_size=256"], {"expert_load": 1.05}),
]


def base_overrides(metrics_dir: str) -> list[str]:
    """The tiny model of ``configs/tiny_cpu.yaml`` (4 layers, hidden 256, 8/2 heads, vocab 8000) on random tokens,
    seq 512, one micro-batch per rank, no checkpoints."""
    return ["data.mock_data=true", "data.prepare_demo_data=false", "checkpoint.save=null", "train.device=cpu",
            "data.seq_length=512", "train.micro_batch_size=1", "train.global_batch_size=null",
            "logging.log_interval=100", f"logging.metrics_file={os.path.join(metrics_dir, 'metrics.jsonl')}"]


def case_config(world: int, overrides: list):
    """The case's Config, layout-checked for ``world`` ranks."""
    from megatron_lc.config import load_config, resolve_layout

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base_overrides(tmp) + list(overrides))
    resolve_layout(cfg, world)
    return cfg


def missing_feature(cfg, world: int) -> Optional[str]:
    """Why this checkout cannot run the case (a feature not implemented yet), or None.

    Builds rank 0's model and sequence layout without process groups (init does not communicate): a missing feature
    raises ``ConfigError('... not implemented yet')`` or ``NotImplementedError``; a feature that exists but needs
    real process groups raises the topology's RuntimeError, which means it can be measured."""
    from megatron_lc.config import ConfigError, resolve_layout
    from megatron_lc.compose import build_model
    from megatron_lc.parallel.token_layout import local_token_index
    from megatron_lc.parallel.topology import Topology

    layout = resolve_layout(cfg, world)
    topo = Topology(world_size=world, tp=layout.tp, cp=layout.cp, ulysses=layout.ulysses, dp=layout.dp, ep=layout.ep)
    try:
        build_model(cfg, layout, topo)
        local_token_index(layout, topo, cfg.data.seq_length)
    except NotImplementedError as e:
        return f"not implemented in this checkout: {e}"
    except ConfigError as e:
        if "not implemented" in str(e).lower():
            return f"not implemented in this checkout: {e}"
        raise
    except RuntimeError as e:
        if "process groups" not in str(e):
            raise
    return None


def measure_case(rank: int, world: int, overrides: list) -> dict:
    """This rank's measured peak live bytes over 2 training steps of the framework (see estimate/measure.py)."""
    import torch

    from megatron_lc.config import load_config
    from megatron_lc.estimate.measure import measure_training_peak
    from megatron_lc.parallel.topology import Topology

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(os.path.join(ROOT, "configs", "tiny_cpu.yaml"), base_overrides(tmp) + list(overrides))
        p = cfg.parallel
        topo = Topology.build(tp=p.tensor_model_parallel_size, cp=p.context_parallel_size, ulysses=p.ulysses_size,
                              ep=p.expert_model_parallel_size)
        out = measure_training_peak(cfg, topo, steps=2)
    out["rank"] = rank
    return out
