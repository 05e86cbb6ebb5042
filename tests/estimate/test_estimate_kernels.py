"""The estimator's kernel efficiencies: each printed with its source (a published figure, a calibration, set by hand,
or measured on a GPU on a date); the backend that will run (``auto`` without a measured table: torch, FA2-class)
and the Hopper-native what-if beside it; the measured attention table (``attention_measured``, written by
bench/attention_kernels.py) replacing the profile's figures, ``auto`` resolved to the fastest measured backend (its
kernels' memory too: no GQA copies with cuDNN), and what MFU target the attention kernels reach."""
from __future__ import annotations

import os
import shutil

import pytest

from megatron_lc.attention.kernel_table import write_table
from megatron_lc.config import ConfigError, load_config
from megatron_lc.estimate import estimate, load_hardware
from megatron_lc.estimate.hardware import HARDWARE_DIR
from megatron_lc.estimate.tables import estimate_table, target_line
from megatron_lc.estimate.time_estimate import call_weights
from megatron_lc.units import GIB
from tools import estimate as estimate_tool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "llama3_8b_1m.yaml")
FA2 = ["--hw-set", "efficiency.attention_fwd=0.35", "--hw-set", "efficiency.attention_bwd=0.30"]
TABLE = {"gpu": "NVIDIA H100 80GB HBM3", "capability": "9.0", "date": "2026-12-01",
         "versions": {"torch": "2.13.0+cu128", "cudnn": 91002}, "peak_tflops": 989,
         "backends": {"torch": {k: {"fwd": 0.34, "bwd": 0.29} for k in ("ring_diagonal", "ring_block", "ulysses")},
                      "cudnn": {k: {"fwd": 0.70, "bwd": 0.60} for k in ("ring_diagonal", "ring_block")}}}


@pytest.fixture
def measured_h100(tmp_path):
    path = str(tmp_path / "h100.yaml")
    shutil.copy(os.path.join(HARDWARE_DIR, "h100.yaml"), path)
    write_table(path, TABLE)
    return path


def test_the_shipped_1m_estimate_names_the_kernel_that_runs_and_the_hopper_what_if():
    est = estimate(load_config(CONFIG), load_hardware("h100"), 8)
    text = estimate_table(est)
    assert est.time.attention_backend == "torch" and est.backend_named == "auto"
    assert "attention that runs: torch (auto: no kernel measured on H100-80GB, so PyTorch's FlashAttention-2-class " \
           "one) forward 0.34, backward 0.33 of peak (FlashAttention-3 paper, Figs. 5-6" in text, text
    assert "gemm 0.70 of peak (assumed" in text
    what_if = [ln for ln in text.splitlines() if "what-if, a Hopper-native kernel (parallel.attention_backend=fa3)"
               in ln]
    assert what_if and "forward 0.62, backward 0.57 of peak (FlashAttention-3 paper" in what_if[0], text
    fa3 = estimate(load_config(CONFIG, ["parallel.attention_backend=fa3"]), load_hardware("h100"), 8)
    assert f"step {fa3.time.step_seconds:.1f} s, MFU {fa3.time.mfu:.1%}" in what_if[0]
    assert fa3.time.mfu > 1.6 * est.time.mfu  # attention is ~94% of the step: FA3's 0.62 / 0.57 against 0.34 / 0.33
    assert call_weights(est.dims) == {"ring_diagonal": 1 / 8, "ring_block": 7 / 8}  # ring cp 8


def test_a_measured_table_replaces_the_assumed_attention_and_auto_takes_the_fastest(measured_h100):
    cfg = load_config(CONFIG)
    hw = load_hardware(measured_h100)
    auto = estimate(cfg, hw, 8)
    torch_named = estimate(load_config(CONFIG, ["parallel.attention_backend=torch"]), hw, 8)
    assert auto.time.attention_backend == "cudnn" and torch_named.time.attention_backend == "torch"
    src = "measured (NVIDIA H100 80GB HBM3, 2026-12-01)"
    assert auto.time.efficiencies["attention forward"] == (0.70, src)
    assert auto.time.efficiencies["gemm"] == (0.70, hw.efficiency.gemm_source)
    assert f"attention that runs: cudnn (auto: the fastest measured on NVIDIA H100 80GB HBM3) forward 0.70, " \
           f"backward 0.60 of peak ({src})" in estimate_table(auto)
    assert auto.time.mfu > torch_named.time.mfu
    # both take the kv heads as they are; cuDNN's backward makes the QKV projection's gapped q, k, v dense, flash's
    # holds dk, dv at the query heads (device/kernel_scratch.py): within 1 GiB of each other at this layout
    assert abs(auto.memory.peak - torch_named.memory.peak) < 1 * GIB
    # a backend measured for other calls than the layout's: the profile's published figure, said so
    ulysses = estimate(load_config(CONFIG, ["parallel.cp_comm_type=a2a", "parallel.ulysses_size=8",
                                            "parallel.attention_backend=cudnn"]), hw, 8)
    assert ulysses.time.efficiencies["attention forward"] == (0.545, hw.attention["cudnn"].source)
    assert "what-if" not in estimate_table(auto)  # a Hopper-native backend already runs


def test_the_target_line_names_the_measured_backend_that_reaches_it(measured_h100):
    hw = load_hardware(measured_h100)
    est = estimate(load_config(CONFIG, ["parallel.attention_backend=torch"]), hw, 8)
    line = target_line(est, 8, 0.5)
    assert line.startswith("50% MFU needs attention at") and "reached by cudnn (0.70 / 0.60)" in line, line
    assert "reaches the 50% target" in target_line(estimate(load_config(CONFIG), hw, 8), 8, 0.5)


def test_auto_with_hand_set_efficiencies_says_which_backend_50_percent_needs(capsys):
    """The shipped 1M config, every backend's attention set by hand to FA2-class values (0.35 / 0.30): ~27% MFU,
    and 50% needs a Hopper-native kernel; --auto ranks with the backend that runs."""
    assert estimate_tool.main(["--config", CONFIG, "--hardware", "h100", "--auto", "--top", "1", *FA2]) == 0
    out = capsys.readouterr().out
    assert "forward 0.35, backward 0.30 of peak (set by hand)" in out
    need = [ln for ln in out.splitlines() if ln.startswith("50% MFU needs attention at")]
    assert need and "now torch at 0.35 / 0.30, set by hand" in need[0], out
    assert "a Hopper-native one, cudnn, fa3, fa4" in out


def test_a_profile_figure_can_be_set_by_hand_per_backend():
    hw = load_hardware("h100", {"attention": {"torch": {"fwd": 0.5}}})
    assert (hw.attention["torch"].fwd, hw.attention["torch"].bwd, hw.attention["torch"].source) == \
        (0.5, 0.326, "set by hand")
    with pytest.raises(ConfigError, match="hardware.attention.torch"):
        load_hardware("h100", {"attention": {"torch": {"fwd": 0.5, "speed": 1}}})


def test_hw_set_mistakes_are_one_line(capsys):
    assert estimate_tool.main(["--config", CONFIG, "--hw-set", "efficiency.attention_fwd"]) == 2
    assert estimate_tool.main(["--config", CONFIG, "--hw-set", "efficiency.attention_fwd=1.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "KEY=VALUE" in err[0] and "attention_fwd (1.5) must be in (0, 1]" in err[1], err


def test_write_table_replaces_the_old_table_and_keeps_the_comments(measured_h100):
    write_table(measured_h100, {**TABLE, "date": "2026-12-02"})
    text = open(measured_h100).read()
    assert [ln for ln in text.splitlines() if ln.startswith("attention_measured:")] == ["attention_measured:"]
    assert "# NVIDIA H100 80GB SXM5" in text and text.count("# attention_measured: written by") == 1
    assert load_hardware(measured_h100).attention_measured.date == "2026-12-02"
    with pytest.raises(ConfigError, match="needs fwd and bwd efficiencies"):
        write_table(measured_h100, {**TABLE, "backends": {"torch": {"ulysses": {"fwd": 0}}}})
