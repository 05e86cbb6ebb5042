"""Unit tests of the estimator: hardware profiles, formulas against hand-worked numbers and the papers, the α LP,
the layout search and the command line. The calibration against measured peaks is
tests/estimate/test_estimate_calibration.py.
"""
from __future__ import annotations

import json
import os

import pytest
import yaml

from megatron_lc.config import ConfigError, load_config, resolve_layout
from megatron_lc.estimate import estimate, load_hardware
from megatron_lc.estimate import attention_kernels as K
from megatron_lc.estimate import transient as T
from megatron_lc.estimate.dims import Dims
from megatron_lc.estimate.flops import model_flops_per_sample
from megatron_lc.estimate.hardware import HARDWARE_DIR
from megatron_lc.estimate.inventory import group_bytes, layer_chunk_share, layer_skeletal, param_shards
from megatron_lc.estimate.layout_search import LAYER_CHUNK, apply_overrides, config_overrides, pick_best, search_layouts
from megatron_lc.estimate.tables import activation_peak_from, load_measured
from megatron_lc.estimate.terms.memo_offload import solve_alpha
from megatron_lc.planning.trace import Trace, max_live_bytes
from megatron_lc.training.metrics import flops_per_sample
from megatron_lc.units import GIB

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIGS = os.path.join(ROOT, "configs")
PROFILES = sorted(f[:-5] for f in os.listdir(HARDWARE_DIR) if f.endswith(".yaml"))
# the shipped llama3_8b_1m.yaml carries the layout --auto wrote; tests start from a fixed one
RESET = ["parallel.tensor_model_parallel_size=1", "parallel.context_parallel_size=8", "parallel.cp_comm_type=a2a",
         "parallel.ulysses_size=8", "parallel.sequence_parallel=false", "memory.activation_offload=none",
         "memory.offload_fraction=auto", "memory.mst=false", "memory.recompute_granularity=none"]


def llama(*overrides):
    """Llama3-8B at 1M tokens (configs/llama3_8b_1m.yaml) with Ulysses over 8 GPUs and no memory feature, then
    ``overrides``."""
    return load_config(os.path.join(CONFIGS, "llama3_8b_1m.yaml"), RESET + list(overrides))


@pytest.mark.parametrize("name", PROFILES)
def test_every_hardware_profile_loads(name):
    hw = load_hardware(name)
    assert hw.device_bytes > 0 and hw.peak_flops(True) > 0 and hw.host_bytes_per_node > 0


def test_hardware_profiles_shipped():
    assert {"a100", "a800", "h100", "h200"} <= set(PROFILES)


def test_hardware_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="hardware profile not found: b200"):
        load_hardware("b200")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhbm_gbit: 3\n")
    with pytest.raises(ConfigError, match="unknown key 'hardware.hbm_gbit'"):
        load_hardware(str(bad))
    bad.write_text("name: x\nreserved_gib: 90\nmemory_gib: 80\n")
    with pytest.raises(ConfigError, match=r"reserved_gib \(90.0\)"):
        load_hardware(str(bad))


# the Hugging Face families' switches on the tiny model (model:, megatron_lc/hf/families.py)
FAMILY_SWITCHES = {
    "qwen2": ["model.add_qkv_bias=true"],
    "qwen3": ["model.qk_layernorm=true"],
    "gemma3": ["model.qk_layernorm=true", "model.apply_layernorm_1p=true", "model.post_self_attn_layernorm=true",
               "model.post_mlp_layernorm=true", "model.swiglu=false", "model.gated_linear_unit=true",
               "model.scale_embeddings=true", "model.kv_channels=48"],
    # an MoE with Qwen2-MoE's gated shared expert and a dense first layer (model/moe.py, estimate/moe.py)
    "moe": ["model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=128",
            "model.moe_layer_freq=0,1,1,1", "model.moe_shared_expert_intermediate_size=192",
            "model.moe_shared_expert_gate=true"],
}


@pytest.mark.parametrize("config,overrides", [(c, []) for c in ("tiny_cpu.yaml", "llama3_8b_1m.yaml", "gpt_7b.yaml",
                                                                 "qwen3_8b_1m.yaml", "qwen3_32b_1536k.yaml",
                                                                 "qwen3_30b_a3b_2m.yaml")]
                         + [("tiny_cpu.yaml", v) for v in FAMILY_SWITCHES.values()],
                         ids=["tiny", "llama3-8b", "gpt-7b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b"]
                         + list(FAMILY_SWITCHES))
def test_parameter_inventory_matches_model_count(config, overrides):
    cfg = load_config(os.path.join(CONFIGS, config), overrides)
    dims = Dims.from_config(cfg, resolve_layout(cfg, 1 if config == "tiny_cpu.yaml" else 8), "cuda")
    full = Dims(**{**dims.__dict__, "tp": 1, "cp": 1, "dp": 1, "sequence_parallel": False})
    assert sum(n for _, n, _ in param_shards(full)) == cfg.model.num_parameters()


@pytest.mark.parametrize("name,billions", [("qwen3_8b_1m.yaml", 8.19), ("qwen3_32b_1536k.yaml", 32.76)])
def test_qwen3_configs_have_qwen3s_parameter_counts(name, billions):
    """Qwen3-8B and Qwen3-32B as their model cards count them (8.2B and 32.8B, embeddings and the untied head
    included): head_dim 128 is not hidden / heads in the 32B (5120 / 64 = 80), and the q/k norms are counted."""
    assert load_config(os.path.join(CONFIGS, name)).model.num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)


def test_qwen3_30b_a3b_counts_its_parameters_and_active_ones_as_its_card():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (its model card); the estimator's model FLOPs (what MFU is
    relative to) count the active ones (6 s P_active + 6 n (nq d) s^2), as the trainer's metrics do; the model
    built at ep 8 holds 1/8 of the experts a rank."""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_30b_a3b_2m.yaml"))
    m = cfg.model
    assert m.num_parameters() / 1e9 == pytest.approx(30.53, abs=0.01)
    assert m.num_active_parameters() / 1e9 == pytest.approx(3.35, abs=0.01)
    dims = Dims.from_config(cfg, resolve_layout(cfg, 8), "cuda")
    s = cfg.data.seq_length
    assert model_flops_per_sample(dims) == pytest.approx(6 * s * m.num_active_parameters()
                                                         + 6 * m.num_layers * 32 * 128 * s * s)
    ep8 = Dims(**{**dims.__dict__, "ep": 8})
    experts = sum(n for name, n, _ in param_shards(ep8) if ".mlp.experts." in name)
    assert experts == 48 * 16 * 3 * 2048 * 768


def test_the_qwen3_30b_a3b_configs_carry_the_layout_auto_picks():
    """configs/qwen3_30b_a3b_1m.yaml and _2m.yaml hold what ``--auto --write`` wrote for 8 H100s (expert
    parallelism among the layouts weighed; ep 1 is the fastest: the experts' compute is the same on every layout,
    the all-to-alls only add), and it fits."""
    for name in ("qwen3_30b_a3b_1m.yaml", "qwen3_30b_a3b_2m.yaml"):
        cfg = load_config(os.path.join(CONFIGS, name))
        best = pick_best(search_layouts(cfg, load_hardware("h100"), 8))
        assert best.est.status == "fits"
        with open(os.path.join(CONFIGS, name)) as f:
            shipped = yaml.safe_load(f)
        for key, value in config_overrides(best).items():
            section, field = key.split(".")
            assert shipped[section].get(field) == value, (name, key, value, best.label())


def test_model_flops_are_memos_formula_and_the_trainers():
    """Memo §5.1: 6·s·P + 6·n·h·s², the same figure training/metrics.py logs as MFU."""
    cfg = llama()
    dims = Dims.from_config(cfg, resolve_layout(cfg, 8), "cuda")
    s, m = cfg.data.seq_length, cfg.model
    assert model_flops_per_sample(dims) == pytest.approx(6 * s * m.num_parameters()
                                                         + 6 * m.num_layers * 4096 * s * s)
    assert model_flops_per_sample(dims) == pytest.approx(flops_per_sample(cfg))


def test_skeletal_bytes_reproduce_memo_figure5_16bsh():
    """GPT layer, MHA, f = 4h, everything in 16-bit (as Megatron keeps it), token-wise grouping: input 1 + attention
    output 1 + others 14 = 16·b·s·h elements (Memo §3.2, Figure 5); only norm statistics and lse come on top."""
    cfg = load_config(None, ["model.hidden_size=4096", "model.num_attention_heads=32", "model.ffn_hidden_size=16384",
                             "model.normalization=LayerNorm", "model.swiglu=false", "data.seq_length=8192",
                             "train.bf16=true"])
    dims = Dims(**{**Dims.from_config(cfg, resolve_layout(cfg, 1), "cuda").__dict__, "residual_bytes": 2})
    g = group_bytes(layer_skeletal(dims, mlp_chunked=False, fpdt_offload=False, token_wise=True))
    bsh = dims.tokens * dims.hidden
    assert g["input"] == 2 * bsh
    assert g["attn"] == pytest.approx(2 * bsh, rel=0.02)  # + lse: nq fp32 per token = 1.6% of 2h bytes
    assert g["others"] == pytest.approx(28 * bsh, rel=0.01)  # + LayerNorm mean/rstd


def test_alpha_lp_memo_example():
    """The worked example of docs/memo_offload.md (Memo §5.1 hardware, 7B at 1M tokens, tp 8): host-bound at
    α = (256/30 - 2)/14 = 0.4667, bandwidth would allow 15.8."""
    a, why = solve_alpha(GIB, GIB, 14 * GIB, 32e9, 7.5, 32, 256 * GIB)
    assert a == pytest.approx((256 / 30 - 2) / 14, rel=1e-9) and why == "host memory"
    a, why = solve_alpha(GIB, GIB, 14 * GIB, 1e9, 0.5, 32, 256 * GIB)  # slow link: input+attn do not even overlap
    assert a == 0.0 and why == "PCIe bandwidth"
    assert solve_alpha(GIB, GIB, 14 * GIB, 32e9, 100.0, 32, 10_000 * GIB) == (1.0, "alpha = 1")


def test_memo_alpha_auto_and_host_limit():
    cfg = llama("parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=4",
                "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1", "parallel.sequence_parallel=true",
                "memory.activation_offload=memo", "memory.mst=true")
    hw = load_hardware("h100")
    est = estimate(cfg, hw, 8)
    assert 0 < est.memory.alpha < 1 and est.memory.host_per_node <= est.memory.host_capacity * (1 + 1e-9)
    small = estimate(cfg, hw.with_measured({"host_memory_gib": 64.0}), 8)  # α = 0 does not fit 64 GiB
    assert small.memory.alpha == 0.0 and small.status == "oohm"


def test_memo_alpha_auto_leaves_fpdts_host_chunks_their_share():
    """FPDT's parked chunks are reserved in the host pool before Memo calibrates (memory/memo/profiler.py), so the
    LP's budget is what they leave: α chosen by host memory keeps the node within its host memory. Before, the LP
    took the whole share and FPDT came on top (bf16 residual: α 1, 2124 of 1638 GiB, "out of host memory" at the α it
    chose; now α 0.325 and the node's 1638 GiB to the byte)."""
    cfg = llama("parallel.cp_comm_type=fpdt", "memory.fpdt_chunk_size=65536", "memory.fpdt_offload=true",
                "memory.activation_offload=memo", "memory.mst=true", "model.fp32_residual_connection=false")
    est = estimate(cfg, load_hardware("h100"), 8)
    assert 0 < est.memory.alpha < 1 and any("binding: host memory" in n for n in est.memory.notes)
    assert est.memory.host_per_node <= est.memory.host_capacity * (1 + 1e-9), est.memory.host_per_node / GIB
    assert est.status == "fits"


def test_features_reduce_memory_in_the_expected_order():
    base = ["data.seq_length=131072", "parallel.tensor_model_parallel_size=8", "parallel.context_parallel_size=1",
            "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1", "parallel.sequence_parallel=true"]
    hw = load_hardware("h100")
    peak = {}
    for name, extra in {"none": [], "full": ["memory.recompute_granularity=full"], "mst": ["memory.mst=true"],
                        "memo": ["memory.activation_offload=memo", "memory.offload_fraction=0.25",
                                 "memory.mst=true"]}.items():
        peak[name] = estimate(llama(*base, *extra), hw, 8).memory.peak
    assert peak["memo"] < peak["full"] < peak["none"] and peak["mst"] < peak["none"]


def test_time_model_is_consistent():
    cfg = llama("data.seq_length=262144")
    hw = load_hardware("h100")
    t = estimate(cfg, hw, 8).time
    assert t.step_seconds == pytest.approx(sum(t.parts.values()), rel=1e-9)
    assert 0 < t.mfu < hw.efficiency.gemm  # below the best kernel efficiency: communication and attention cost
    assert t.tokens_per_gpu_per_s == pytest.approx(262144 / (t.step_seconds * 8))
    # a measured layer time (Memo profiler) replaces the computed one: twice the layer time, about twice the step
    slow = estimate(cfg, hw.with_measured({"layer_forward_seconds": 2 * t.t_layer_fwd}), 8).time
    assert slow.step_seconds > 1.8 * t.step_seconds


def test_bad_layout_is_a_config_error():
    cfg = llama("parallel.tensor_model_parallel_size=3")
    with pytest.raises(ConfigError, match=r"divisible by tp \(3\) x cp \(8\)"):
        estimate(cfg, load_hardware("h100"), 8)


def test_auto_on_llama3_8b_1m_fits_on_8_h100():
    cfg = llama()
    cands = search_layouts(cfg, load_hardware("h100"), 8)
    assert cands and all(c.est.status == "fits" for c in cands)
    best = pick_best(cands)
    assert best.est.memory.peak <= best.est.memory.capacity
    assert best.step_seconds <= cands[0].step_seconds * 1.005
    # memory.layer_chunk_size is searched (16K local rows of 128K) and always written, None when unchunked
    chunked = [c for c in cands if c.overrides["memory.layer_chunk_size"] == LAYER_CHUNK]
    assert chunked and all("chunks16K" in c.label() for c in chunked)
    assert all(config_overrides(c)["memory.layer_chunk_size"] in (None, LAYER_CHUNK) for c in cands)
    assert not any(c.overrides["memory.activation_offload"] == "none" and c.overrides["memory.recompute_granularity"]
                   == "none" and c.overrides["memory.layer_chunk_size"] for c in cands)


def test_the_qwen3_8b_config_is_a_layout_auto_weighs():
    """configs/qwen3_8b_1m.yaml holds what ``tools/estimate.py --auto --write`` wrote for 8 H100s (tp 1, ring cp 8,
    Memo alpha 0.25, MsT, FSDP2): it fits and its step is within ``pick_best``'s 0.5% of the fastest that fits, the
    set ``--auto`` picks from. (With the FA2-class attention figures of the kernel that runs, the pick among those
    moved to alpha 0 in 16K-row chunks, 0.1% slower with more host memory free.)"""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_8b_1m.yaml"))
    hw = load_hardware("h100")
    shipped = estimate(cfg, hw, 8)
    fastest = search_layouts(cfg, hw, 8)[0]
    assert shipped.status == "fits"
    assert shipped.time.step_seconds <= fastest.step_seconds * 1.005, (shipped.time.step_seconds, fastest.label())


def test_the_qwen3_32b_config_is_a_layout_auto_weighs():
    """configs/qwen3_32b_1536k.yaml keeps the layout it was rehearsed in (tp 4 + SP, ring cp 2, host checkpoints in
    chunks, MsT, FSDP2 with CPU offload; the residual stream in bf16): it fits and its step is within ``pick_best``'s
    0.5% of the fastest that fits, the set ``--auto`` picks from (it now picks FPDT in the chunked layer, 0.3% faster
    with the host 98% full: the config's header says so)."""
    cfg = load_config(os.path.join(CONFIGS, "qwen3_32b_1536k.yaml"))
    hw = load_hardware("h100")
    shipped = estimate(cfg, hw, 8)
    fastest = search_layouts(cfg, hw, 8)[0]
    assert shipped.status == "fits"
    assert shipped.time.step_seconds <= fastest.step_seconds * 1.005, (shipped.time.step_seconds, fastest.label())


def test_layer_chunks_share_and_working_set():
    """c local rows of S = s/cp/tp (SP) per mini-sequence; a chunk holding every re-run row is no chunking; the
    chunked re-run holds less than the whole one when the MLP (not the attention backward) sets the peak."""
    hw = load_hardware("h100")
    base = ["data.seq_length=262144", "parallel.tensor_model_parallel_size=2", "parallel.context_parallel_size=4",
            "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1", "parallel.sequence_parallel=true",
            "memory.mst=true"]
    S = 262144 // 4 // 2
    for feature in (["memory.recompute_granularity=full"], ["memory.activation_offload=checkpoints"],
                    ["memory.activation_offload=memo", "memory.offload_fraction=0"]):
        whole = estimate(llama(*base, *feature), hw, 8)
        chunked = estimate(llama(*base, *feature, "memory.layer_chunk_size=2048"), hw, 8)
        assert layer_chunk_share(chunked.cfg, chunked.dims) == 2048 / S
        assert layer_chunk_share(llama(*base, *feature, f"memory.layer_chunk_size={S}"), whole.dims) is None
        assert chunked.memory.peak < whole.memory.peak, feature
        assert chunked.time.step_seconds == whole.time.step_seconds  # no FLOPs added (an assumption)
    memo1 = llama(*base, "memory.activation_offload=memo", "memory.offload_fraction=1", "memory.layer_chunk_size=1")
    assert layer_chunk_share(memo1, whole.dims, alpha=1.0) is None  # nothing dropped, nothing re-run


def test_cli_auto_write_then_estimate(tmp_path, capsys):
    from tools.estimate import main

    out = tmp_path / "llama.yaml"
    assert main(["--config", os.path.join(CONFIGS, "llama3_8b_1m.yaml"), "--hardware", "h100", "--auto",
                 "--top", "3", "--write", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen layout" in printed and "status: FITS" in printed
    raw = yaml.safe_load(out.read_text())
    assert raw["model"]["hidden_size"] == 4096 and raw["memory"]["activation_offload"] in ("memo", "none")
    assert out.read_text().startswith("# Llama3-8B")  # the comment block survives
    assert main(["--config", str(out), "--hardware", "h100"]) == 0  # the written layout estimates as fitting
    assert "status: FITS" in capsys.readouterr().out


def test_cli_oom_and_errors(capsys):
    from tools.estimate import main

    cfg = os.path.join(CONFIGS, "llama3_8b_1m.yaml")
    plain = [a for kv in RESET for a in ("--set", kv)]
    assert main(["--config", cfg, "--hardware", "h100"] + plain) == 1  # Ulysses alone keeps every layer: OOM
    assert "OOM" in capsys.readouterr().out
    assert main(["--config", cfg, "--hardware", "h100"]) == 0  # the layout --auto wrote into the shipped config
    assert "status: FITS" in capsys.readouterr().out
    assert main(["--config", cfg, "--hardware", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: hardware profile not found: tpu") and err.count("\n") == 1
    assert main(["--config", cfg, "--write"]) == 2


def test_measured_inputs_from_the_memo_profiler_log(tmp_path):
    line = ('[12:00:00 rank0] memo offload: {"alpha": 0.3, "profile": {"s_input": 1, "t_layer": 0.25, '
            '"bw_d2h": 21000000000.0, "bw_h2d": 22000000000.0, "host_node_bytes": 1099511627776}}')
    p = tmp_path / "log.txt"
    p.write_text(line)
    got = load_measured(str(p))
    assert got == {"layer_forward_seconds": 0.25, "pcie_gbps": 21.0, "host_memory_gib": 1024.0,
                   "host_usable_fraction": 1.0}
    hw = load_hardware("h100").with_measured(got)
    assert hw.host_bytes_per_node == 1024 * GIB and hw.layer_forward_seconds == 0.25


def test_plan_and_trace_replace_the_activation_formulas(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"peak_bytes": 5 * GIB, "lower_bound_bytes": 5 * GIB, "offsets": {}}))
    assert activation_peak_from(str(plan), None) == 5 * GIB
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(e) for e in [
        {"op": "malloc", "id": 1, "size": 100}, {"op": "malloc", "id": 2, "size": 50},
        {"op": "free", "id": 1, "size": 100}, {"op": "malloc", "id": 3, "size": 120}]))
    assert max_live_bytes(Trace.load(str(trace)).requests()) == 170
    cfg = load_config(os.path.join(CONFIGS, "tiny_cpu.yaml"), ["data.mock_data=true"])
    a = estimate(cfg, load_hardware("cpu"), 2)
    b = estimate(cfg, load_hardware("cpu"), 2, activation_peak_override=GIB)
    assert b.memory.parts["activation peak (at its moment)"] == GIB and b.memory.peak > a.memory.peak


@pytest.mark.parametrize("gpus,seq", [(8, 4194304), (32, 16777216)], ids=["4M-on-8", "16M-on-32"])
def test_issue_17_lengths_fit_with_a_bf16_residual_stream(gpus, seq):
    """Llama3-8B at 4M tokens on 8 H100s and 16M on 32 (the h100 profile's host memory): a layout fits once the
    residual stream -- every host checkpoint -- is bf16 (``model.fp32_residual_connection: false``, Megatron's
    default). With the framework's fp32 default the host checkpoints alone are 2 TiB per node, over 1,638 GiB usable."""
    hw = load_hardware("h100")
    bf16 = search_layouts(llama(f"data.seq_length={seq}", "model.fp32_residual_connection=false"), hw, gpus,
                          features={"memory.activation_offload": "checkpoints"})
    assert bf16 and bf16[0].est.status == "fits"
    best = bf16[0]
    assert best.overrides["memory.layer_chunk_size"] is not None, best.label()  # the chunked re-run is what fits
    host_ckpt = 32 * seq * 4096 * 2 / (gpus // 8)  # 32 layers x tokens x hidden, bf16, per node
    assert best.est.memory.host_per_node >= host_ckpt
    fp32 = estimate(apply_overrides(llama(f"data.seq_length={seq}"), config_overrides(best)), hw, gpus)
    assert fp32.memory.host_per_node >= 2 * host_ckpt and fp32.status != "fits"


def _dims(cfg, world, device="cuda"):
    return Dims.from_config(cfg, resolve_layout(cfg, world), device)


def test_fused_cuda_attention_copies_are_counted_per_kernel_call():
    """What PyTorch's fused CUDA kernels hold beyond their inputs and outputs (``device/kernel_scratch.py``): the
    flash backward takes the kv heads as they are (no repeat) and holds inside itself an fp32 dq accumulator (2 Q)
    with its softmax sums (Q / 64) and, under GQA, dk, dv at the query heads (2 Q); dout is not copied (the kernel's
    transpose of the cores' view is contiguous at batch 1). Llama3-8B at 1M tokens on 8 GPUs (32 query, 8 kv heads;
    Q = q of the rank's tokens, 1 GiB in both layouts): Ulysses' inner kernel (after the all-to-all) 9.02 Q above
    q, k, v, out, lse and dout (5 Q with flash-attn, which this table does not read); cuDNN there 7.02 Q (its fp32
    dQ accumulator, no GQA expansion; q, k, v fresh from the all-to-all, so not copied); tp2 cp4 ring, rank 0's third
    block (back queries x all keys): 12.02 Q. None on CPU, whose kernel is another."""
    uly = llama()
    dims = _dims(uly, 8)
    Q = dims.tokens * dims.heads_local * dims.head_dim * 2
    assert Q == GIB
    assert K.attention_backward_lse(uly, dims) == (9 + 1 / 64) * Q
    flash = llama("parallel.attention_backend=flash")
    assert K.attention_backward_lse(flash, _dims(flash, 8)) == 5 * Q
    cudnn = llama("parallel.attention_backend=cudnn")
    assert K.attention_backward_lse(cudnn, _dims(cudnn, 8)) == (7 + 1 / 64) * Q
    cpu = K.attention_backward_lse(uly, _dims(uly, 8, "cpu"))
    assert cpu == K.attention_backward_lse(flash, _dims(flash, 8, "cpu"))
    ring = llama("parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                 "parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1")
    assert K.attention_backward_lse(ring, _dims(ring, 8)) == (12 + 1 / 64) * Q


def test_one_gpu_reruns_pre_moment_and_ropes_temporaries():
    """One H100 at 512K tokens, every token re-run (Memo with alpha 0, MsT, FSDP2 CPU offload): the dropped tokens'
    pre re-run before the attention backward holds the layer input's grad (8 GiB), dout (4), norm 1's fp32 output
    and its bf16 cast (8 + 4), the QKV output and q copied out of it (6 + 4) and RoPE's fp32 temporaries of q --
    1.5 x 8 since ``apply_rotary`` writes its halves into one buffer (3.5 x 8 before: 62 GiB, the rehearsal's peak
    then) -- 46 GiB; the attention backward's moment, 49.06 GiB, is now the largest (in it the flash kernel's fp32 dq
    accumulator and GQA's dk, dv at the query heads, 16.06 GiB, where k, v repeated for the kernel were counted)."""
    cfg = load_config(os.path.join(CONFIGS, "llama3_8b_1m.yaml"), [
        "data.seq_length=524288", "parallel.context_parallel_size=1", "memory.offload_fraction=0",
        "parallel.fsdp_cpu_offload=true"])
    dims = _dims(cfg, 1)
    U = dims.tokens_residual * dims.hidden * dims.residual_bytes
    Q = dims.tokens * dims.heads_local * dims.head_dim * dims.compute_bytes
    assert U + Q + T.pre_no_graph(dims, dims.tokens, graph=True) == 46 * GIB
    assert T.tokenwise_backward(cfg, dims, 1.0) == (49 + 1 / 16) * GIB
