"""Nothing silent: every wrong path, broken file and finished run is told to the user in one line, and nothing the
user had is overwritten or lost. One test per case; a subprocess where the launcher or the printed line is what
matters (exact message, exit code, no traceback)."""
from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_lc.config import load_config
from megatron_lc.config.data import demo_files
from megatron_lc.data import DataError
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.support.parity import small_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tools"))
TINY = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=32", "data.mock_data=true", "train.micro_batch_size=2", "train.global_batch_size=2",
        "train.device=cpu", "logging.peak_tflops=1"]


@pytest.fixture(autouse=True)
def info_logs(caplog):
    caplog.set_level(logging.INFO, logger="megatron_lc")


def pretrain(*sets: str, launcher: list[str] = ()):
    """``python pretrain_gpt.py [launcher args] --config configs/tiny_cpu.yaml --set ...`` from the repo root."""
    cmd = [sys.executable, "pretrain_gpt.py", *launcher, "--config", "configs/tiny_cpu.yaml"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "error:" in ln]


def assert_one_error(out, message: str, code: int = 2) -> None:
    """Exit ``code``, no traceback, and ``error: message`` as the only error line."""
    assert out.returncode == code, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert error_lines(out.stderr) == [f"error: {message}"], out.stderr[-2000:]


def listing(path) -> dict:
    """{relative file: bytes} below ``path`` (what the user had)."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = open(p, "rb").read()
    return out


def train(tmp_path, *extra, iters=2):
    cfg = small_config(TINY + [f"train.train_iters={iters}", f"checkpoint.save={tmp_path / 'run'}"] + list(extra))
    return Trainer(cfg, Topology()).train()


# ---- checkpoint.load -----------------------------------------------------------------------------------------------
def test_load_path_that_does_not_exist(tmp_path):
    out = pretrain(*TINY, "checkpoint.save=null", f"checkpoint.load={tmp_path}/ckpt_typo")
    assert_one_error(out, f"checkpoint.load ({tmp_path}/ckpt_typo) does not exist")


def test_load_of_a_hugging_face_directory(tmp_path):
    hf = tmp_path / "Llama-3.2-1B"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "llama"}')
    (hf / "model.safetensors").write_bytes(b"")
    out = pretrain(*TINY, "checkpoint.save=null", f"checkpoint.load={hf}")
    assert_one_error(out, f"checkpoint.load ({hf}) is a Hugging Face model directory, not a megatron_lc checkpoint; "
                          f"import it first: python tools/convert_from_hf.py {hf} OUT_DIR")


def test_load_of_a_directory_without_checkpoints(tmp_path):
    out = pretrain(*TINY, "checkpoint.save=null", f"checkpoint.load={tmp_path}")
    assert_one_error(out, f"checkpoint.load ({tmp_path}) holds no megatron_lc checkpoint (no iter_*/meta.json)")


def test_load_equal_to_save_with_nothing_saved_starts_fresh(tmp_path, caplog):
    """The first start of an auto-resuming job (SLURM requeue: load == save) is not an error."""
    state = train(tmp_path, f"checkpoint.load={tmp_path / 'run'}")
    assert state.iteration == 2
    assert f"no checkpoint in {tmp_path / 'run'} yet: starting from scratch" in caplog.text


# ---- demo data -----------------------------------------------------------------------------------------------------
def test_demo_never_writes_a_path_you_name(tmp_path):
    out = pretrain("train.train_iters=1", "checkpoint.save=null", f"data.data_path={tmp_path}/my_corpus")
    assert_one_error(out, "data.prepare_demo_data builds the demo's own files under data/demo/ and never writes a "
                          "path you name: unset data.data_path, or set data.prepare_demo_data: false to train on them")
    assert os.listdir(tmp_path) == []


def test_missing_files_you_name_are_an_error(tmp_path):
    out = pretrain("train.train_iters=1", "checkpoint.save=null", "data.prepare_demo_data=false",
                   f"data.data_path={tmp_path}/corpus", f"data.tokenizer_model={tmp_path}/typo.model")
    assert_one_error(out, f"tokenizer model not found: {tmp_path}/typo.model (train one with tools/train_tokenizer.py)")
    assert os.listdir(tmp_path) == []


def test_demo_files_are_keyed_by_vocabulary(monkeypatch):
    """A demo run with another vocabulary builds (and reads) its own tokenizer and data, never the 8000-token ones."""
    from megatron_lc.training import entry

    built = []
    monkeypatch.setattr(entry, "prepare_demo_data", lambda *a: built.append(a))
    for vocab in (8000, 32000):
        entry.prepare_data(load_config("configs/tiny_cpu.yaml", [f"model.vocab_size={vocab}"]), rank=0)
    assert built == [(*demo_files(8000), 8000), (*demo_files(32000), 32000)]
    assert demo_files(32000) == ("data/demo/stdlib_py_sp32000", "data/demo/stdlib_py_sp32000.model")


# ---- broken checkpoint files -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncate-data", "delete-metadata"])
def test_broken_newest_checkpoint_falls_back_to_the_older_one(tmp_path, damage, caplog):
    train(tmp_path, "checkpoint.save_interval=2", iters=4)  # iter 2 and iter 4
    newest = tmp_path / "run" / "iter_0000004"
    if damage == "truncate-data":  # weights and AdamW states (torch.distributed.checkpoint's file of rank 0)
        f = newest / "__0_0.distcp"
        f.write_bytes(f.read_bytes()[:1000])
        why = f"{f} is truncated or corrupt (1000 bytes, saved "
    else:
        f = newest / ".metadata"
        f.unlink()
        why = f"{f} is missing"
    before = listing(newest)
    # with the fallback off: one line naming the file, nothing touched
    out = pretrain(*TINY, "train.train_iters=6", f"checkpoint.save={tmp_path / 'run'}",
                   f"checkpoint.load={tmp_path / 'run'}", "checkpoint.load_fallback=false")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = error_lines(out.stderr)
    assert line.startswith(f"error: cannot resume: {why}") and line.endswith(
        "(checkpoint.load_fallback: true resumes from the newest older checkpoint that loads)")
    # by default: the newest checkpoint that loads, said once
    state = train(tmp_path, f"checkpoint.load={tmp_path / 'run'}", "checkpoint.save_interval=2", iters=6)
    assert state.iteration == 6 and len(state.losses) == 4  # steps 3-6 after resuming at 2
    assert f"because {why}" in caplog.text and "an older checkpoint" in caplog.text
    # the damaged checkpoint is set aside, as it was, and said; the resumed run saved iteration 4 anew
    corrupt = tmp_path / "run" / "iter_0000004.corrupt"
    assert f"set aside {newest} as {corrupt}: it does not load" in caplog.text
    assert listing(corrupt) == before and (newest / "meta.json").exists()


def test_checksums_are_written_and_checked(tmp_path):
    train(tmp_path)
    meta = json.loads((tmp_path / "run" / "iter_0000002" / "meta.json").read_text())
    assert set(meta["files"]) == {".metadata", "__0_0.distcp", "rng_rank00000.pt"}
    assert all(re.fullmatch(r"[0-9a-f]{64}", v["sha256"]) and v["bytes"] > 0 for v in meta["files"].values())
    model = tmp_path / "run" / "iter_0000002" / "__0_0.distcp"
    data = bytearray(model.read_bytes())
    data[-100] ^= 0xFF  # same size, one bit pattern changed
    model.write_bytes(bytes(data))
    out = pretrain(*TINY, "train.train_iters=3", f"checkpoint.save={tmp_path / 'run'}",
                   f"checkpoint.load={tmp_path / 'run'}")
    assert_one_error(out, f"cannot resume: no checkpoint in {tmp_path / 'run'} loads ({model} is corrupt (sha256 "
                          f"differs from its meta.json))")


# ---- launcher --------------------------------------------------------------------------------------------------------
def test_layout_error_under_the_launcher_is_one_line_before_anything_starts():
    out = pretrain("parallel.tensor_model_parallel_size=3", launcher=["--nproc-per-node", "3"])
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == "error: model.num_attention_heads (8) must be divisible by tp (3)\n"


def test_rank_error_under_the_launcher_is_one_line_without_launcher_traceback(tmp_path):
    out = pretrain("checkpoint.save=null", "data.prepare_demo_data=false", f"data.data_path={tmp_path}/none",
                   "data.tokenizer_type=NullTokenizer", launcher=["--nproc-per-node", "2"])
    assert_one_error(out, f"data file not found: {tmp_path}/none.bin (data.data_path is the prefix of a .bin/.idx "
                          f"pair; make one with tools/preprocess_data.py)")
    assert "ChildFailedError" not in out.stderr


def test_error_under_bare_torchrun_is_printed_once(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "pretrain_gpt.py", "--config",
           "configs/tiny_cpu.yaml", "--set", "checkpoint.save=null", "--set", "data.prepare_demo_data=false",
           "--set", f"data.data_path={tmp_path}/none", "--set", "data.tokenizer_type=NullTokenizer"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    message = (f"error: data file not found: {tmp_path}/none.bin (data.data_path is the prefix of a .bin/.idx pair; "
               f"make one with tools/preprocess_data.py)")
    assert [ln for ln in out.stderr.splitlines() if ln.startswith("error: data file not found")] == [message]
    assert f"traceback : {message}" in out.stderr  # and torchrun's summary names it (the ranks' error files)


# ---- one checkpoint.save, one run ------------------------------------------------------------------------------------
def test_save_directory_of_another_run_is_refused_and_left_alone(tmp_path):
    train(tmp_path)
    before = listing(tmp_path / "run")
    out = pretrain(*TINY, "train.train_iters=2", f"checkpoint.save={tmp_path / 'run'}")
    assert_one_error(out, f"checkpoint.save ({tmp_path / 'run'}) already holds a run (checkpoints up to iteration 2): "
                          f"to resume that run add --set checkpoint.load={tmp_path / 'run'}; to start another, give "
                          f"it its own directory with --set checkpoint.save=NEW_DIR")
    assert listing(tmp_path / "run") == before


def test_resumed_run_marks_its_metrics_and_plots_the_resume(tmp_path):
    import plot_metrics

    train(tmp_path)
    train(tmp_path, f"checkpoint.load={tmp_path / 'run'}", iters=4)
    mfile = tmp_path / "run" / "metrics.jsonl"
    recs = [json.loads(ln) for ln in mfile.read_text().splitlines()]
    assert [r.get("resumed_from") and r["step"] for r in recs] == [None, None, 2, None, None]
    assert recs[2]["resumed_from"] == str(tmp_path / "run" / "iter_0000002")
    assert plot_metrics.resume_points(str(mfile)) == [2]
    assert [r["step"] for r in plot_metrics.read_metrics(str(mfile))] == [1, 2, 3, 4]
    assert plot_metrics.main([str(mfile), "-o", str(tmp_path / "m.png")]) == 0


def test_fresh_run_moves_an_earlier_metrics_file_aside(tmp_path, caplog):
    mfile = tmp_path / "m.jsonl"
    mfile.write_text('{"step": 1, "loss": 9.0}\n')
    Trainer(small_config(TINY + ["train.train_iters=1", f"logging.metrics_file={mfile}"]), Topology()).train()
    assert (tmp_path / "m.1.jsonl").read_text() == '{"step": 1, "loss": 9.0}\n'
    assert [json.loads(ln)["step"] for ln in mfile.read_text().splitlines()] == [1]
    assert f"{mfile} held an earlier run's metrics: moved to {tmp_path / 'm.1.jsonl'}" in caplog.text


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path):
    train(tmp_path)
    out = pretrain(*TINY, "train.train_iters=2", f"checkpoint.save={tmp_path / 'run'}",
                   f"checkpoint.load={tmp_path / 'run'}")
    assert out.returncode == 0 and "Traceback" not in out.stderr
    assert ("nothing to do: the checkpoint is at iteration 2 and train.train_iters is 2 (raise train.train_iters to "
            "train on)") in out.stderr


# ---- README, MFU, progress, positions --------------------------------------------------------------------------------
def test_readme_commands_use_the_venv():
    text = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    commands = [ln.strip() for b in blocks for ln in b.splitlines() if ln.strip() and not ln.startswith("#")]
    bare = [c for c in commands if re.match(r"(python3?|torchrun|pip) ", c)]
    assert commands and not bare, bare


def test_mfu_is_never_above_100_percent(tmp_path, caplog):
    over = Trainer(small_config(TINY[:-1] + ["train.train_iters=2", "logging.peak_tflops=1e-9",
                                             f"logging.metrics_file={tmp_path}/a.jsonl"]), Topology())
    over.train()
    recs = [json.loads(ln) for ln in open(tmp_path / "a.jsonl")]
    assert [r["mfu"] for r in recs] == [None, None]
    assert caplog.text.count("MFU came out at") == 1 and "that peak is too low for this machine" in caplog.text
    Trainer(small_config(TINY[:-1] + ["train.train_iters=2", f"logging.metrics_file={tmp_path}/b.jsonl"]),
            Topology()).train()
    assert re.search(r"MFU is relative to [0-9.e+-]+ TFLOP/s per rank \(measured: fp32 GEMM 256x256, median of "
                     r"\d+ over 0.5 s \([0-9.e+-]+-[0-9.e+-]+ TFLOP/s\); logging.peak_tflops fixes it\)", caplog.text)
    assert all(0 < json.loads(ln)["mfu"] <= 1 for ln in open(tmp_path / "b.jsonl"))


def test_mfu_notice_is_rank_0_s_alone_and_its_advice_fits_the_peak(tmp_path, caplog, monkeypatch):
    from megatron_lc.training import loop
    from tests.dist_cases import train as dist_cases_train
    from tests.support.dist import run_dist

    assert [len(m) for m in run_dist(2, dist_cases_train.mfu_notices)] == [1, 0]  # rank 1 says nothing
    set_peak = Trainer(small_config(TINY[:-1] + ["train.train_iters=2", "logging.peak_tflops=1e-9"]), Topology())
    set_peak.train()
    said = [r.getMessage() for r in caplog.records if "MFU came out at" in r.getMessage()]
    assert len(said) == 1 and "raise logging.peak_tflops to this machine's peak, or unset it" in said[0], said
    caplog.clear()
    monkeypatch.setattr(loop, "peak_flops", lambda cfg, execution: (1e3, "measured: fp32 GEMM 1024x1024"))
    Trainer(small_config(TINY[:-1] + ["train.train_iters=2"]), Topology()).train()
    said = [r.getMessage() for r in caplog.records if "MFU came out at" in r.getMessage()]
    assert len(said) == 1 and "unset" not in said[0] and "set logging.peak_tflops to this machine's peak" in said[0]


def test_preprocessing_shows_progress(tmp_path):
    from megatron_lc.data.tokenizer import train_sentencepiece

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"def f{i}(x): return x * {i}"}) for i in range(2000)))
    txt = tmp_path / "c.txt"
    txt.write_text("\n".join(f"def f{i}(x): return x * {i}" for i in range(2000)))
    model = train_sentencepiece([str(txt)], str(tmp_path / "sp"), 300)
    out = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--tokenizer-model",
                          model, "--output-prefix", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert out.returncode == 0, out.stderr
    assert re.search(r"tokenizing: .*tok/s.*docs=2000", out.stderr), out.stderr[-500:]
    install = open(os.path.join(ROOT, "scripts", "install.sh")).read()
    # pip is quiet (the demo's output starts with training) and a line before it says what is being installed
    pips = [ln for ln in install.splitlines() if "pip install" in ln]
    assert pips and all("pip install -qq " in ln for ln in pips) and 'echo "installing into .venv' in install


def test_rope_past_max_positions_is_said_and_exported(tmp_path, caplog):
    import convert_to_hf

    Trainer(small_config(TINY + ["train.train_iters=1", "model.max_position_embeddings=16",
                                 f"logging.metrics_file={tmp_path}/m.jsonl"]), Topology()).train()
    assert ("data.seq_length (32) exceeds model.max_position_embeddings (16): RoPE goes past the length the model was "
            "declared for; set max_position_embeddings to at least 32 (an export records 32)") in caplog.text
    cfg = small_config(TINY + ["model.max_position_embeddings=16"])
    assert convert_to_hf.export_config(cfg.model, "float32", False, None, None, cfg.data.seq_length)[
        "max_position_embeddings"] == 32


# ---- tools -----------------------------------------------------------------------------------------------------------
def test_estimator_table_shows_the_chosen_layout_after_the_top_rows_and_defines_tgs():
    from megatron_lc.estimate.tables import search_table
    from megatron_lc.estimate.layout_search import pick_best, search_layouts
    from megatron_lc.estimate import load_hardware

    cfg = load_config("configs/llama3_8b_1m.yaml")
    cands = search_layouts(cfg, load_hardware("h100"), 8)
    best = pick_best(cands)
    rows = search_table(cands, 1, best).splitlines()
    top = [r for r in rows[1:] if re.match(r"[ *] *\d+ ", r)]
    assert len(top) == (1 if cands[0] is best else 2)
    if cands[0] is not best:
        assert rows[2].strip() == "..." and top[1].startswith(f"*{cands.index(best) + 1:>2} ")
    assert rows[-1].startswith("TGS: tokens per GPU per second")


def test_exported_safetensors_have_their_siblings_permissions(tmp_path):
    import convert_to_hf

    convert_to_hf.write_safetensors({"w": torch.zeros(4)}, str(tmp_path), 1 << 30)
    (tmp_path / "config.json").write_text("{}")
    assert os.stat(tmp_path / "model.safetensors").st_mode & 0o777 == os.stat(tmp_path / "config.json").st_mode & 0o777


# ---- data files ------------------------------------------------------------------------------------------------------
def test_token_ids_past_the_vocabulary_name_the_file_and_position(tmp_path):
    from megatron_lc.data.indexed import write_indexed

    prefix = str(tmp_path / "corpus")
    write_indexed(prefix, [list(range(100)), [5] * 30 + [300] + [5] * 69])  # 300: past model.vocab_size 256
    # NullTokenizer: the files' ids below data.vocab_size, its end-of-document id 255 (model.vocab_size 256)
    cfg = small_config(TINY + ["train.train_iters=20", "data.mock_data=false", f"data.data_path={prefix}",
                               "data.tokenizer_type=NullTokenizer", "data.vocab_size=255",
                               f"logging.metrics_file={tmp_path}/m.jsonl"])
    with pytest.raises(DataError) as e:
        Trainer(cfg, Topology()).train()
    assert str(e.value) == (f"{prefix}.bin: token id 300 at token 130 (document 1, position 30) is outside the "
                            f"vocabulary (model.vocab_size 256): the file was made with another tokenizer, or "
                            f"model.vocab_size is too small")


def test_a_short_index_is_one_line_without_megatron_core_traceback(tmp_path):
    from megatron_lc.data.indexed import write_indexed

    prefix = str(tmp_path / "corpus")
    write_indexed(prefix, [list(range(50)), list(range(70))])
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(40)
    out = pretrain(*TINY, "checkpoint.save=null", "data.mock_data=false", "data.prepare_demo_data=false",
                   f"data.data_path={prefix}", "data.tokenizer_type=NullTokenizer")
    assert_one_error(out, f"{prefix}.idx: cannot be read (ValueError: buffer is smaller than requested size)")
    assert "Exception ignored" not in out.stderr


def test_out_of_host_memory_is_one_line_with_the_bytes_and_a_hint(tmp_path):
    """An address-space limit (16 GiB) stands in for a small host: a model whose embedding alone needs 32 GiB."""
    script = tmp_path / "limited.py"
    script.write_text(f"import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (16 << 30, resource.RLIM_INFINITY))"
                      f"\nsys.path.insert(0, {ROOT!r})\nimport pretrain_gpt\nsys.exit(pretrain_gpt.main(sys.argv[1:]))\n")
    cmd = [sys.executable, str(script), "--config", "configs/tiny_cpu.yaml"]
    for s in TINY + ["model.vocab_size=131072", "model.hidden_size=65536", "checkpoint.save=null"]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=300)
    (line,) = error_lines(out.stderr)
    assert out.returncode == 3 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert re.fullmatch(r"error: out of host memory: an allocation of \d+ bytes \(\d+\.\d GiB\) failed; pick a layout "
                        r"that needs less .* python tools/estimate.py --config CONFIG --hardware HW --auto lists "
                        r"layouts with their host memory", line), line
