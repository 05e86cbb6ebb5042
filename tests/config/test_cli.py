"""pretrain_gpt.py as a user runs it: the demo trains under torchrun; user mistakes give one-line errors."""
import json
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def run(cmd, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, **kw)


def test_demo_trains_on_two_ranks_and_writes_metrics_and_checkpoint(tmp_path):
    """The README demo, shortened: real text (stdlib sources), 2 gloo ranks, loss falls clearly."""
    out = run(TORCHRUN + ["--nproc-per-node", "2", "pretrain_gpt.py", "--config", "configs/tiny_cpu.yaml",
                          "--set", "train.train_iters=16", "--set", "train.lr_warmup_iters=4",
                          "--set", f"checkpoint.save={tmp_path}/run", "--set", "checkpoint.save_interval=8"])
    assert out.returncode == 0, out.stderr[-3000:]
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(1, 17))
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.5, [r["loss"] for r in recs]
    assert sorted(os.listdir(tmp_path / "run")) == ["iter_0000008", "iter_0000016",
                                                    "latest_checkpointed_iteration.txt", "metrics.jsonl",
                                                    "run_outcome.txt"]
    assert "MFU" in out.stderr and "tok/gpu/s" in out.stderr


def test_config_mistake_is_one_line_and_exit_2():
    out = run([sys.executable, "pretrain_gpt.py", "--config", "configs/tiny_cpu.yaml", "--set", "model.hiden_size=3"])
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: unknown key 'model.hiden_size'")


def test_impossible_layout_under_torchrun_names_the_numbers():
    out = run(TORCHRUN + ["--nproc-per-node", "2", "pretrain_gpt.py", "--config", "configs/tiny_cpu.yaml",
                          "--set", "parallel.tensor_model_parallel_size=4"])
    assert out.returncode != 0
    # torchrun's own failure report (with a launcher traceback) follows; our message is the "error:" line
    assert "error: world size (2) must be divisible by tp (4) x cp (1) = 4" in out.stderr


def test_missing_data_file_is_a_clear_error(tmp_path):
    out = run([sys.executable, "pretrain_gpt.py", "--config", "configs/tiny_cpu.yaml", "--set",
               "data.prepare_demo_data=false", "--set", f"data.data_path={tmp_path}/none",
               "--set", "data.tokenizer_type=NullTokenizer", "--set", "checkpoint.save=null"])
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: data file not found: {tmp_path}/none.bin" in out.stderr
