"""The rehearsal (megatron_lc/rehearsal, tools/rehearse.py): the real setup and step under fake tensors and a fake
process group -- every layout family on 8 simulated ranks of the tiny model to the end of 2 steps, a host tensor
in device math reported (and unnoticed by an ordinary CPU run), the summary line as documented."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.dist_cases import rehearsal as cases
from tests.support.dist import run_dist

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def rehearse_cli(config: str, *args: str, sets: tuple = ()) -> subprocess.CompletedProcess:
    """``tools/rehearse.py --config config args...`` with a ``--set`` for each of ``sets``, run from the checkout's
    root, its stdout and stderr captured as text."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "tools", "rehearse.py"), "--config", config, *args]
                          + [a for x in sets for a in ("--set", x)], cwd=ROOT, capture_output=True, text=True)


def test_a_host_tensor_in_device_math_is_reported_by_the_rehearsal_only():
    got = run_dist(1, cases.host_math_fault)[0]
    assert got["clean_rehearsal"] == []
    # the host copy is also read without waiting for its offload's event: the stream check may report that too
    host = [v for v in got["violations"] if v["kind"] == "host pool used in device math"]
    sites = {v["site"].split(":", 1)[0] for v in host}
    assert host and "megatron_lc/model/norm.py" in sites, got["violations"]
    assert got["faulty"] == got["clean"]  # on the CPU the same memory: the ordinary run cannot see it


def test_a_host_tensor_in_device_math_stops_the_rehearsal_where_cuda_would():
    """The same planted fault on the stand-in device: the op that mixes the host copy into device math is reported
    with its site and the rank stops there (a GPU run raises at that op)."""
    got = run_dist(1, cases.host_math_fault)[0]
    mixed = [v for v in got["violations"] if v["kind"] == "host and device tensors in one op"]
    assert mixed and mixed[0]["site"].startswith("megatron_lc/model/norm.py"), got["violations"]


def test_the_old_save_check_is_reported_at_its_site_and_stops_the_save():
    """The save's finite check as it was (every sum in one stack, AdamW's host step counts among them), put back:
    the rehearsal stops at the save, naming the stack and the save's site; as it is, the whole job runs."""
    planted = run_dist(1, cases.planted_save_bug, True)[0]
    assert planted["stopped"]["at"] == "save", planted
    [v] = planted["violations"]
    assert v["op"] == "aten.stack.default" and "host tensor" in v["buffer"], v
    assert v["site"].startswith("megatron_lc/training/checkpointing/save.py"), v
    fixed = run_dist(1, cases.planted_save_bug, False)[0]
    assert fixed["stopped"] is None and fixed["violations"] == [], fixed
    assert fixed["job"] == ["validation", "save", "async save", "resume", "resumed step"]


def test_validation_save_async_save_and_resume_run_in_the_rehearsal():
    """The job after the steps on rank 7 of 8, for FSDP2 in bf16 (a GPU run's usual layout), Memo, ring and tp 2
    with FSDP2's CPU offload: every part runs with no violation; the checkpoint is complete (meta.json, DCP's
    metadata, the RNG file; its tensors' bytes counted, not written) and the step after the resume holds what a
    steady-state step holds; the async save stages the checkpoint's bytes on the host."""
    got = run_dist(1, cases.rehearse_job, ["fsdp2", "memo", "ring", "tp2-fsdp2-offload"])[0]
    for name, r in got.items():
        assert r["stopped"] is None and r["violations"] == [], (name, r["stopped"], r["violations"])
        assert r["job"] == ["validation", "save", "async save", "resume", "resumed step"], (name, r["job"])
        assert {"meta.json", ".metadata", "rng_rank00007.pt"} <= set(r["files"]), (name, r["files"])
        assert not any(f.endswith(".distcp") for f in r["files"]), (name, r["files"])
        p = r["phases"]
        assert r["checkpoint_bytes"] > 0 and p["async save"]["host_peak_bytes"] >= r["checkpoint_bytes"], (name, p)
        assert p["resumed step"]["device_peak_bytes"] == p["steps"]["device_peak_bytes"], (name, p)
        for phase in ("validation", "save", "async save", "resume"):
            assert 0 < p[phase]["device_peak_bytes"] <= p["steps"]["device_peak_bytes"], (name, phase, p)
    # FSDP2's CPU offload keeps the shards on the host: the save hands DCP those tensors (DTensors on a host mesh),
    # not device copies of them, so no phase of the checkpoint holds its pieces on the device (with the pieces
    # built on FSDP's device mesh, ``DTensor.from_local`` copied all of them there: 11.3 MB on top) -- and a load
    # fills the shards themselves. The workspaces CUDA's libraries keep from their first call on (cuBLAS's, each
    # communicator's NCCL buffers: 448 MiB here, ``device/kernel_scratch.py``) are on the device in every phase.
    r = got["tp2-fsdp2-offload"]
    p = r["phases"]
    for phase in ("save", "async save", "resume"):
        assert p[phase]["device_peak_bytes"] - r["kernel_scratch_kept_bytes"] < r["checkpoint_bytes"], (phase, p, r)


CALIBRATION = ["plain", "small-vocab", "gpt-layernorm-gelu", "recompute-full", "mst", "memo-alpha0",
               "memo-alpha1-mst", "ckpt-offload", "ckpt-offload-chunks", "recompute-full-chunks",
               "memo-alpha0-chunks"]


def test_the_rehearsed_peak_equals_the_real_runs_on_the_estimators_calibration_cases():
    """The same tracker on a real CPU run and on its rehearsal under fake tensors: within 3% (measured: equal to
    the byte on these cases); the fake run's allocations are the real run's, so a larger difference is a storage
    the fake path makes or keeps that the real one does not."""
    got = run_dist(1, cases.rehearsal_vs_real, CALIBRATION)[0]
    assert len(got) >= 10
    for name, r in got.items():
        assert abs(r["rehearsed"] / r["real"] - 1) <= 0.03, (name, r)
        assert r["violations"] == [], (name, r["violations"])


def test_every_layout_family_rehearses_on_8_ranks_to_the_end_of_2_steps():
    """The tiny model at 8 simulated ranks in every layout family (ring, Ulysses, hybrid, FPDT with offload, tp2+SP,
    Memo, MsT, FSDP2 with and without CPU offload, host checkpoints in chunks), ranks 0 and 7: both steps to their
    optimizer step, setup never above the step, no violation of stream order or host memory."""
    got = run_dist(1, cases.rehearse_families, list(cases.FAMILIES))[0]
    for name, ranks in got.items():
        for rank, r in ranks.items():
            dev = r["device"]
            assert len(r["seconds"]["steps"]) == 2 and dev["peak_moment"].startswith("step"), (name, rank, dev)
            assert 0 < dev["setup_peak_bytes"] <= dev["peak_bytes"], (name, rank, dev)
            assert r["violations"] == [], (name, rank, r["violations"])
            assert r["comm_bytes_per_step"], (name, rank)
    # FSDP2 builds on the meta device and makes each rank's shards alone: no setup holds the whole model (built on
    # the host, every rank held all of it -- Llama-3.1-70B's 263 GiB, eight times on a node), only its shards
    # (1/8, fp32, on the host with the CPU offload) and, while it draws one, one parameter's full tensor -- and
    # small tensors, less than 64 KiB (measured: 1 KiB more; built on the host: 30 MB, the whole model)
    sizes = [p.numel() * 4 for p in cases.plain_model(cases.EIGHT).parameters()]
    for name in ("fsdp2", "fsdp2-offload"):
        for rank, r in got[name].items():
            host = r["phases"]["setup"]["host_peak_bytes"]
            assert host <= sum(sizes) / 8 + max(sizes) + 2 ** 16, (name, rank, host, sum(sizes), max(sizes))


def test_the_command_line_prints_the_summary_line_last_and_writes_its_json(tmp_path):
    """``tools/rehearse.py``: one rank of two of the tiny config; the last line as documented, the JSON beside it;
    bad input is one line (exit 2) before any rank starts."""
    import json

    base = ("configs/tiny_cpu.yaml", "--nproc-per-node", "2", "--set", "train.global_batch_size=8")
    out = rehearse_cli(*base, "--ranks", "1", "--out", str(tmp_path / "r.json"))
    last = out.stdout.strip().splitlines()[-1]
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.match(r"rehearsal: 1 ranks, max peak device \d+\.\d\d GiB \(estimator \d+\.\d\d GiB allocated, "
                    r"[+-]\d+\.\d%(; \d+\.\d\d GiB with its fragmentation reserve)?\), "
                    r"max host \d+\.\d\d GiB, 0 violations", last), last
    assert last.endswith("; ran: 2 steps, validation, save, async save, resume, resumed step"), last
    report = json.load(open(tmp_path / "r.json"))
    assert list(report["ranks"]) == ["1"] and report["summary"]["world"] == 2
    said = [m.group(1) for m in (re.fullmatch(r"rank 1: (.+) \(at \d+ s\)", ln) for ln in out.stdout.splitlines()) if m]
    assert said == ["setup"] + [f"setup {s}" for s in ("data", "build", "device", "runtimes", "optimizer",
                                                       "checkpoint")] + [
        f"step {k} {p}" for k in (0, 1) for p in ("forward", "backward", "optimizer")] + [
        "validation", "save", "async save", "resume"] + [f"step 2 {p}" for p in ("forward", "backward", "optimizer")
                                                         ], out.stdout
    assert [ln.split(":")[0] for ln in out.stdout.splitlines() if ln.startswith("phase ")] == [
        f"phase {p}" for p in ("setup", "steps", "validation", "save", "async save", "resume", "resumed step")]
    bad = rehearse_cli(*base, "--ranks", "5")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --ranks ('5'): ranks must be in [0, 2) for 2 ranks"], bad.stderr


def test_one_step_is_set_beside_the_estimators_first_step_and_says_why(tmp_path):
    """``--steps 1`` ends before AdamW's states exist: a note says so, the last line sets the peak beside the
    estimator's first step (equal here) and names the steady-state peak and the one with the reserve. In bf16, as a
    GPU run: the tiny model's GQA in fp32 takes CUDA's math attention kernel at cp 1 (the memory-efficient one has no
    GQA), which the estimator does not count (docs/rehearsal.md)."""
    import json

    out = rehearse_cli("configs/tiny_cpu.yaml", "--nproc-per-node", "2", "--ranks", "1", "--steps", "1",
                       "--steps-only", "--out", str(tmp_path / "r.json"),
                       sets=("train.global_batch_size=8", "train.bf16=true"))
    assert out.returncode == 0, out.stderr[-2000:]
    *_, note, last = out.stdout.strip().splitlines()
    assert note.startswith("note: one step ends before AdamW's states exist"), note
    assert re.fullmatch(r"rehearsal: 1 ranks, max peak device \d+\.\d\d GiB \(estimator \d+\.\d\d GiB allocated in "
                        r"step 1, before AdamW's states, [+-]\d+\.\d%; \d+\.\d\d GiB from step 2 on, \d+\.\d\d GiB "
                        r"with its fragmentation reserve\), max host \d+\.\d\d GiB, 0 violations; ran: 1 steps only",
                        last), last
    s = json.load(open(tmp_path / "r.json"))["summary"]
    assert s["steps"] == 1 and s["estimator_optimizer_states_bytes"] > 0
    assert abs(s["difference_first_step"]) <= 0.03 and s["difference"] < -0.1, s


def test_progress_lines_are_passed_on_while_the_rank_runs(tmp_path):
    """``tools/rehearse.py`` hands a rank's progress line on as it comes: this stand-in rank goes on only once the
    line's handler has made a file (it gives up after 60 s), so a reader that waited for the end would fail."""
    from megatron_lc.rehearsal.rank import PROGRESS

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import rehearse

    gate = tmp_path / "gate"
    child = (f"import os, sys, time\nprint({PROGRESS + 'setup data'!r}, flush=True)\nt = time.time()\n"
             f"while not os.path.exists({str(gate)!r}):\n    if time.time() - t > 60: sys.exit(3)\n"
             f"    time.sleep(0.01)\nprint('done')\n")
    said = []

    def on_phase(name):
        said.append(name)
        gate.write_text("")

    with open(tmp_path / "err", "w+") as err:
        code, other = rehearse.follow([sys.executable, "-c", child], dict(os.environ), err, on_phase)
    assert (code, said, other) == (0, ["setup data"], ["done\n"])


def test_ulysses_with_documents_in_chunked_checkpoints_is_within_5_percent_of_the_estimator():
    """The 4M layout (``configs/llama3_8b_4m.yaml``: tp 2 + SP, Ulysses cp 4, host checkpoints in 16K chunks, MsT,
    FSDP2 with CPU offload) cut to 2 layers and 512K tokens, packed 8K documents, rank 0, the steps: the rehearsed
    peak within 5% of the estimator's (the causal cut: +3.6%). The peak is the re-run's attention backward through
    the variable-length calls, which add into fp32 dq, dk, dv (``fused_cuda.backward_rects``); counted as the
    kernel's grads in the compute dtype the estimator was 11.3% under (at 4M: 75.26 GiB rehearsed, 68.69 estimated).
    With what CUDA's kernels hold inside themselves charged on both sides (``device/kernel_scratch.py``: the varlen
    backward's fp32 dq accumulator and GQA's dk, dv at the query heads, 2.05 GiB of this cut's peak; cuBLAS's and 3
    communicators' NCCL workspaces): 13.59 GiB rehearsed, 13.17 estimated, +3.2%."""
    out = rehearse_cli("configs/llama3_8b_4m.yaml", "--ranks", "0", "--steps-only",
                       sets=("data.seq_length=524288", "model.num_layers=2", "data.mean_document_length=8192",
                             "data.reset_attention_mask=true"))
    assert out.returncode == 0, out.stderr[-2000:]
    last = out.stdout.strip().splitlines()[-1]
    diff = float(re.search(r"GiB allocated, ([+-]\d+\.\d)%", last).group(1))
    assert abs(diff) <= 5.0, last


def test_an_moe_model_under_expert_parallelism_rehearses_with_its_all_to_all_beside_the_estimators():
    """A tiny MoE (8 experts of 256, top-2) at ep 2, rank 0, fp32 (so the experts run as the loop over their row
    groups, whose sizes a rehearsal cannot read: the rows split evenly): both steps run, and the experts'
    all-to-alls send what the estimator's formula says at the stated load (every expert rank 1.25x its fair share),
    the counts' exchange (a few integers) aside. Seen failing before the even split: the loop's host read of fake
    counts (DataDependentOutputException)."""
    import json
    import tempfile

    sets = ("model.vocab_size=256", "data.seq_length=2048", "model.num_moe_experts=8", "model.moe_router_topk=2",
            "model.moe_ffn_hidden_size=256", "model.moe_aux_loss_coeff=0.01", "parallel.expert_model_parallel_size=2",
            "train.global_batch_size=2", "train.micro_batch_size=1")
    with tempfile.TemporaryDirectory() as d:
        out = rehearse_cli("configs/tiny_cpu.yaml", "--nproc-per-node", "2", "--ranks", "0", "--steps-only",
                           "--out", os.path.join(d, "r.json"), sets=sets)
        assert out.returncode == 0, out.stderr[-2000:]
        moe = json.load(open(os.path.join(d, "r.json")))["summary"]["expert_all_to_all_bytes"]
    assert "each expert rank received 1.25 x its fair share" in out.stdout, out.stdout
    for phase in ("fwd", "bwd"):
        assert 0 <= moe["rehearsed"][phase] - moe["formula"][phase] <= 1024, moe


def test_memo_sizes_its_rounding_buffers_from_a_layer_input_in_the_residual_streams_dtype(tmp_path):
    """With a bf16 residual stream (``model.fp32_residual_connection: false`` under bf16 autocast) a layer's input
    is bf16: Memo's calibration probes layer 0 with an input of that dtype (``model/probe.probe_input``), so each
    rounding buffer holds what a step places (the estimator's kept bytes: input + attention output + lse at alpha
    0) and no more. Seen failing with the probe in fp32: 1,605,632 bytes a buffer where the step places 1,081,344
    (the input counted twice its size; Qwen3-30B-A3B at 2M on 8: 1 GiB a buffer, 2 GiB of the device's peak)."""
    import json

    out = rehearse_cli("configs/tiny_cpu.yaml", "--nproc-per-node", "1", "--ranks", "0", "--steps-only", "--steps",
                       "1", "--out", str(tmp_path / "r.json"),
                       sets=("memory.activation_offload=memo", "memory.offload_fraction=0",
                             "model.fp32_residual_connection=false", "train.bf16=true"))
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.load(open(tmp_path / "r.json"))
    buffer = got["ranks"]["0"]["host"]["memo_rounding_buffer_bytes"]
    per_buffer = got["summary"]["estimator_parts"]["rounding buffers (Memo)"] / 2  # kept + 32 aligned groups of 256
    assert per_buffer - 32 * 256 <= buffer <= per_buffer, (buffer, per_buffer)
