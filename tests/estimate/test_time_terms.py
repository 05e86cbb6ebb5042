"""The time model's terms, each checked against its arithmetic by hand (the published cells each moves:
``bench/estimate_papers.py --time --terms``, docs/estimator.md "Against the published step times")."""
from __future__ import annotations

import dataclasses
import os

import pytest

from megatron_lc.config import ConfigError, load_config
from megatron_lc.estimate import estimate, load_hardware
from megatron_lc.estimate.flops import head_flops_fwd, layer_flops
from megatron_lc.estimate.inventory import param_shards
from megatron_lc.estimate.sync_time import layer_numels, per_layer_exposed, reduce_groups, sync_seconds, sync_style
from megatron_lc.estimate.terms import LayerShape
from megatron_lc.estimate.terms.mst import MLP_RERUN_COST
from megatron_lc.estimate.time_estimate import attention_kernel, layer_comm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = os.path.join(ROOT, "configs", "llama3_8b_1m.yaml")
GB = 1e9


def llama(*overrides):
    return load_config(LLAMA, ["parallel.use_torch_fsdp2=false", "memory.activation_offload=none",
                               "memory.mst=false", *overrides])


def test_collectives_across_nodes_pool_the_groups_nics():
    """NCCL's rings leave a node on as many NICs as the group has GPUs there: A800 (NVLink 160, IB 20 GB/s a GPU)."""
    hw = load_hardware("a800")
    assert hw.collective_bytes_per_s(8, 1) == 160 * GB  # one node
    assert hw.collective_bytes_per_s(64, 1) == min(160, 8 * 20) * GB  # tp 64 over 8 nodes
    assert hw.collective_bytes_per_s(8, 2) == 4 * 20 * GB  # 4 of the group's ranks in each of 2 nodes
    assert hw.collective_bytes_per_s(8, 8) == 20 * GB  # one rank a node: its own NIC
    assert hw.link_bytes_per_s(8, 8) == 20 * GB  # a ring of point-to-point hops: its slowest
    h100 = load_hardware("h100")  # NVLink 360, IB 45
    assert h100.all_to_all_seconds(31 * GB, 32, 1) == pytest.approx(24 / 45)  # 24 of 31 shares leave the node
    assert h100.all_to_all_seconds(7 * GB, 8, 1) == pytest.approx(7 / 360)


def test_tensor_parallel_across_nodes_in_the_layer_time():
    """tp 16 over two A800 nodes: 4 x 15/16 x tokens x h x 2 bytes each way at the pooled 160 GB/s."""
    est = estimate(llama("parallel.tensor_model_parallel_size=16", "parallel.context_parallel_size=1",
                         "parallel.sequence_parallel=true", "data.seq_length=65536",
                         "model.num_attention_heads=32", "model.num_query_groups=16"),
                   load_hardware("a800"), 16)
    d = est.dims
    comm = layer_comm(d, est.hw, 1.0, 1.0)
    assert comm["tp_fwd"] == pytest.approx(4 * 15 / 16 * d.tokens * d.hidden * 2 / (160 * GB))
    assert comm["tp_fwd"] * 8 == pytest.approx(4 * 15 / 16 * d.tokens * d.hidden * 2 / (20 * GB))  # flat IB's


def test_host_copies_share_a_pcie_switch_uplink():
    """A800: 2 GPUs behind each switch, uplink 28.8 GB/s: 14.4 each when the node's 8 ranks copy, 25 alone; a
    measured bandwidth is taken as it is. Memo's full swapping (alpha 1) of the 7B GPT at 64K on 8 A800s (tp 4,
    cp 2): each of the 30 swapped layers stalls by what its copy exceeds its forward and its backward."""
    hw = load_hardware("a800")
    assert hw.host_copy_bytes_per_s(8) == pytest.approx(14.4 * GB)
    assert hw.host_copy_bytes_per_s(1) == 25 * GB
    assert hw.with_measured({"pcie_gbps": 21.3}).host_copy_bytes_per_s(8) == pytest.approx(21.3 * GB)
    cfg = load_config(os.path.join(ROOT, "configs", "gpt_7b.yaml"),
                      ["data.seq_length=65536", "parallel.tensor_model_parallel_size=4",
                       "parallel.context_parallel_size=2", "parallel.cp_comm_type=p2p", "parallel.ulysses_size=1",
                       "parallel.sequence_parallel=true", "memory.activation_offload=memo",
                       "memory.offload_fraction=1.0", "memory.recompute_granularity=none", "memory.mst=false",
                       "train.global_batch_size=1"])
    est = estimate(cfg, hw, 8, states="megatron")
    g = LayerShape(False, False, True).groups(est.dims)
    xfer = (g["input"] + g["attn"] + g["others"]) / (14.4 * GB)
    fwd, parts, L = est.time.t_layer_fwd, est.time.parts, est.dims.num_layers
    head_f = head_flops_fwd(est.dims) / (hw.peak_flops(True) * hw.efficiency.gemm)
    bwd = (parts["backward compute"] - 2 * head_f + parts["tp communication"] / 2) / L
    assert fwd < xfer and bwd < xfer < 1.1 * bwd  # 103 ms a copy: 40 ms forward, 95 ms backward
    exposed = parts["host transfers (exposed)"]
    assert exposed == pytest.approx((L - 2) * (xfer - fwd + xfer - bwd), rel=1e-9)
    alone = estimate(cfg, dataclasses.replace(hw, pcie_switch_gbps=None), 8, states="megatron")
    assert alone.time.parts["host transfers (exposed)"] < exposed / 2


def test_gradient_sync_as_each_system_issues_it():
    """This framework all-reduces fp32 gradients after the backward and ZeRO-1 broadcasts the parameters, in
    series; Megatron (the megatron what-if) reduce-scatters fp32 under the backward and all-gathers bf16 under the
    next forward; FSDP2 / ZeRO-3 per layer (``per_layer_exposed``)."""
    hw = load_hardware("h100")
    cfg = llama("parallel.context_parallel_size=4", "parallel.use_distributed_optimizer=true",
                "train.global_batch_size=2", "data.seq_length=32768")
    dims = estimate(cfg, hw, 8).dims
    n, numel = 8, layer_numels(dims)[1]
    assert sync_style(cfg, "framework") == "after_backward" and sync_style(cfg, "megatron") == "overlapped"
    serial = (2 * 7 / 8 * 4 * numel + 7 / 8 * 4 * numel) / (360 * GB)
    assert sync_seconds(cfg, dims, hw, "framework", 1, 1, 1, 1) == pytest.approx(serial)
    rs, ag = 7 / 8 * 4 * numel / (360 * GB), 7 / 8 * 2 * numel / (360 * GB)
    assert sync_seconds(cfg, dims, hw, "megatron", 1, 1, 0.0, 0.0) == pytest.approx(rs + ag)
    assert sync_seconds(cfg, dims, hw, "megatron", 1, 1, ag, rs) == 0.0  # hidden under the passes
    fsdp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, use_torch_fsdp2=True,
                                                                 use_distributed_optimizer=False))
    assert sync_style(fsdp, "framework") == "per_layer" and sync_style(cfg, "zero3") == "per_layer"
    assert sync_seconds(fsdp, dims, hw, "framework", 1, 1, 1, 1) == per_layer_exposed(fsdp, dims, hw, n, 1, 1,
                                                                                       "framework")
    assert n == dims.dp * dims.cp


def test_experts_are_summed_over_their_expert_data_ranks_only():
    """Under expert parallelism an expert rank's experts are summed over the dp x cp / ep ranks holding the same
    experts (``optimizer.sync_gradients``), the rest over dp x cp: Qwen3-30B-A3B on 8 ranks, dp 8, ep 4 -- the
    experts' all-reduce over 2 ranks 4 apart, the attention and routers' over 8. Seen failing with every parameter
    over dp x cp."""
    hw = load_hardware("h100")
    cfg = load_config(os.path.join(ROOT, "configs", "qwen3_30b_a3b_1m.yaml"), [
        "parallel.use_torch_fsdp2=false", "parallel.fsdp_cpu_offload=false", "parallel.context_parallel_size=1",
        "parallel.cp_comm_type=p2p",
        "parallel.ulysses_size=1", "parallel.expert_model_parallel_size=4", "memory.activation_offload=none",
        "memory.mst=false", "memory.layer_chunk_size=null", "train.global_batch_size=8", "data.seq_length=4096"])
    dims = estimate(cfg, hw, 8).dims
    assert (dims.dp, dims.ep) == (8, 4)
    shards = param_shards(dims)
    experts = sum(k for name, k, _ in shards if ".mlp.experts." in name)
    dense = sum(k for _, k, _ in shards) - experts
    assert experts > 0 and reduce_groups(dims) == [(dense, 8, 1), (experts, 2, 4)]
    want = 2 * 7 / 8 * 4 * dense / hw.collective_bytes_per_s(8, 1) + 2 * 1 / 2 * 4 * experts / \
        hw.collective_bytes_per_s(2, 4)
    assert sync_seconds(cfg, dims, hw, "framework", 1, 1, 1, 1) == pytest.approx(want)


def test_fsdp_prefetch_exposure_per_layer():
    """A layer's gather hides under the previous layer's forward, its gather and the next one's reduce-scatter under
    its backward; only the excess is exposed, per layer, plus the first gathers and the embedding / head units."""
    hw = load_hardware("h100")
    cfg = llama("parallel.context_parallel_size=8", "parallel.use_torch_fsdp2=true")
    dims = estimate(cfg, hw, 8).dims
    layer, total = layer_numels(dims)
    other = total - dims.num_layers * layer
    bw = 360 * GB
    g, rs = 7 / 8 * 2 * layer / bw, 7 / 8 * 4 * layer / bw
    fixed = 2 * g + 2 * 7 / 8 * 2 * other / bw + 7 / 8 * 4 * other / bw
    assert per_layer_exposed(cfg, dims, hw, 8, 1.0, 1.0, "framework") == pytest.approx(fixed)  # long layers
    assert per_layer_exposed(cfg, dims, hw, 8, 0.0, 0.0, "framework") == \
        pytest.approx(dims.num_layers * (g + g + rs) + fixed)  # layers shorter than their traffic
    f = g / 2
    assert per_layer_exposed(cfg, dims, hw, 8, f, 2 * g + rs, "framework") == \
        pytest.approx(dims.num_layers * (g - f) + fixed)


def test_mst_rerun_at_its_measured_cost():
    """MsT's chunked MLP re-runs at MLP_RERUN_COST (0.26, MsT's Table 6) of the MLP's forward seconds, per layer."""
    hw = load_hardware("h100")
    base = llama("data.seq_length=262144", "parallel.context_parallel_size=8")
    plain, mst = estimate(base, hw, 8), estimate(dataclasses.replace(
        base, memory=dataclasses.replace(base.memory, mst=True)), hw, 8)
    d = mst.dims
    lin_f = layer_flops(d).linear_fwd / (hw.peak_flops(True) * hw.efficiency.gemm)
    mlp = 3 * d.ffn_local / ((d.heads_local + 2 * d.kv_heads_local) * d.head_dim + d.heads_local * d.head_dim
                             + 3 * d.ffn_local)
    assert MLP_RERUN_COST == 0.26
    assert mst.time.parts["recompute"] - plain.time.parts["recompute"] == \
        pytest.approx(d.num_layers * MLP_RERUN_COST * mlp * lin_f)


def test_attention_efficiencies_in_their_order():
    """Measured for the layout's calls > set by hand > the profile's figure for the backend > torch's, said so."""
    hw = load_hardware("h100")
    cfg = llama("parallel.context_parallel_size=8")
    dims = estimate(cfg, hw, 8).dims
    name, f, b, src = attention_kernel(cfg, dims, hw)
    assert (name, f, b) == ("torch", 0.339, 0.326) and src.startswith("FlashAttention-3 paper")
    assert attention_kernel(cfg, dims, hw, "fa3")[1:3] == (0.623, 0.567)
    fa4 = attention_kernel(cfg, dims, hw, "fa4")
    assert fa4[1:3] == (0.339, 0.326) and fa4[3].startswith("no figure for fa4 on H100-80GB: torch's")
    hand = load_hardware("h100", {"efficiency": {"attention_bwd": 0.3}})
    assert attention_kernel(cfg, dims, hand, "fa3")[1:] == (0.623, 0.3, "set by hand")
    with pytest.raises(ConfigError, match="no attention figure for backend 'fa3'"):
        attention_kernel(cfg, dims, dataclasses.replace(hw, attention={}), "fa3")


def test_the_hosts_work_a_step_where_the_hosts_time_is_the_steps():
    """``step_overhead_seconds`` is added once a step, whatever the micro-batches or the layout; the CPU profile
    carries the figures its plain-model fit gave (``bench/estimate_calibration.py --profile``), the GPU profiles no
    overhead. The fit's arithmetic on the docstring's example of ``fit_profile``: four steps made from known factors
    (linears 1.5x, attention 1.1x, 0.02 s) give those factors back, to the float64 solve's rounding."""
    from tests.support.step_time_cases import PROFILE_LENGTHS, fit_profile

    cpu = load_hardware("cpu")
    assert cpu.step_overhead_seconds == 0.017 and cpu.peak_tflops_fp32 == 0.135
    assert (cpu.attention["torch"].fwd, cpu.attention["torch"].bwd) == (0.41, 0.41)
    assert all(load_hardware(n).step_overhead_seconds == 0.0 for n in ("h100", "h200", "a100", "a800"))
    cfg = llama("data.seq_length=262144", "parallel.context_parallel_size=8", "train.global_batch_size=4")
    none = estimate(cfg, dataclasses.replace(load_hardware("h100"), step_overhead_seconds=0.0), 8).time
    some = estimate(cfg, dataclasses.replace(load_hardware("h100"), step_overhead_seconds=0.5), 8).time
    assert none.parts["host work a step"] == 0.0
    assert some.step_seconds - none.step_seconds == pytest.approx(0.5)  # once a step, not per micro-batch (4 here)
    assert some.parts["host work a step"] == 0.5
    parts = {512: (0.170, 0.032, 0.0136), 1024: (0.340, 0.127, 0.0136), 2048: (0.679, 0.506, 0.0136),
             4096: (1.358, 2.025, 0.0136)}
    assert sorted(parts) == list(PROFILE_LENGTHS)
    steps = {n: 1.5 * g + 1.1 * a + o + 0.02 for n, (g, a, o) in parts.items()}
    fit = fit_profile(steps, parts)
    assert fit == pytest.approx({"gemm": 1.5, "attention": 1.1, "step_overhead_seconds": 0.02}, abs=1e-9)
    # the quadratic part is told apart from the linear one: a step 10 ms longer at 4096 only moves the attention
    moved = fit_profile({**steps, 4096: steps[4096] + 0.01}, parts)
    assert moved["attention"] > fit["attention"] and abs(moved["gemm"] - 1.5) < 0.02
    with pytest.raises(ConfigError, match="step_overhead_seconds"):
        load_hardware("cpu", {"step_overhead_seconds": -1})


def test_msts_rerun_cost_and_its_harnesss_host_work_from_the_calibration_pairs(monkeypatch):
    """``bench/paper_times.mst_calibration`` on made-up published seconds: every cell the model's step without the
    harness plus 0.4 s, each MsT cell 0.4 of one MLP forward re-run more where the model counts 0.26. The pair's
    difference gives 0.4 back (the fixed 0.4 s cancels from it); each recompute cell leaves exactly 0.4 s."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    import paper_times

    bare = {"a100": {"step_overhead_seconds": 0.0}}
    cells = {c["id"]: c for c in paper_times.mst_cells()}
    step = {cid: paper_times.predict(c, bare)["step_s"] for cid, c in cells.items()}
    made = []
    for cid, model, tokens, batch, variant, _, kind in paper_times.MST:
        secs = step[cid] + 0.4
        rec = next((r for r, m in paper_times.MST_PAIRS if m == cid), None)
        if rec is not None:  # one MLP forward re-run: the pair's model difference over the cost it counts
            secs = step[rec] + 0.4 + 0.4 * (step[cid] - step[rec]) / MLP_RERUN_COST
        made.append((cid, model, tokens, batch, variant, secs, kind))
    monkeypatch.setattr(paper_times, "MST", made)
    got = paper_times.mst_calibration()
    assert [p["cost"] for p in got["mst_rerun"]["pairs"]] == pytest.approx([0.4, 0.4], abs=1e-3)  # 3 decimals
    left = got["mst_harness"]["left_after_the_model_s"]
    assert left[0] == pytest.approx(0.4, abs=1e-3) and left[2] == pytest.approx(0.4, abs=1e-3)
    assert left[1] > 0.4 and left[3] > 0.4  # the MsT cells also keep the re-run the model under-counts
