"""tools/eval_long.py on the path of a real run: ``--nproc-per-node`` like pretrain_gpt.py, a bad ``--load`` named
before any layout arithmetic, never an older checkpoint than the newest without saying so (refused), and the
passkey prompt as text through the run's Hugging Face tokenizer."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from megatron_lc.data.tokenizer import HuggingFaceTokenizer
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from megatron_lc.training.eval.passkey import PasskeyPrompt
from tests.support.data_util import llama3_tokenizer
from tests.support.parity import LOSS_RTOL, small_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def eval_long(*args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "tools/eval_long.py", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 steps of the small model on mock data, checkpoints at 2 and 4; (config path, save dir)."""
    d = tmp_path_factory.mktemp("evalrun")
    cfg = small_config([f"checkpoint.save={d}/run", "train.train_iters=4", "checkpoint.save_interval=2",
                        "train.global_batch_size=2", "logging.peak_tflops=1"])
    Trainer(cfg, Topology()).train()
    raw = cfg.to_dict()
    raw["checkpoint"]["save"] = None
    with open(d / "config.yaml", "w") as f:
        yaml.safe_dump(raw, f)
    return d / "config.yaml", d / "run"


def test_nproc_per_node_runs_the_ranks_itself(run, tmp_path):
    config, save = run
    common = ["--config", config, "--load", save, "--documents", "2", "--lengths", "32", "--depths", "0.5"]
    one = eval_long(*common, "--out", tmp_path / "one.json")
    two = eval_long(*common, "--out", tmp_path / "two.json", "--nproc-per-node", "2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (a["layout"]["dp"], b["layout"]["dp"]) == (1, 2) and b["iteration"] == 4
    assert abs(a["position_loss"]["mean_loss"] - b["position_loss"]["mean_loss"]) <= LOSS_RTOL * a["position_loss"][
        "mean_loss"]


def test_bad_load_is_named_before_the_layout(run, tmp_path):
    config, save = run
    out = eval_long("--config", config, "--load", tmp_path / "nowhere", "--out", tmp_path / "r.json",
                    "--set", "parallel.tensor_model_parallel_size=3", "--nproc-per-node", "2")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert [ln for ln in out.stderr.splitlines() if "error" in ln] == [f"error: --load {tmp_path / 'nowhere'}: "
                                                                       f"no such directory"]
    (tmp_path / "empty").mkdir()
    out = eval_long("--config", config, "--load", tmp_path / "empty", "--out", tmp_path / "r.json")
    assert out.stderr.strip().splitlines()[-1] == (f"error: --load {tmp_path / 'empty'} holds no megatron_lc "
                                                   f"checkpoint (no iter_*/meta.json)")


def test_an_older_checkpoint_than_the_newest_is_refused(run, tmp_path):
    import shutil

    config, save = run
    copy = tmp_path / "run"
    shutil.copytree(save, copy)
    data = copy / "iter_0000004" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    out = eval_long("--config", config, "--load", copy, "--out", tmp_path / "r.json", "--lengths")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: the newest checkpoint {copy / 'iter_0000004'} does not load, and eval_long evaluates only the "
        f"newest: pass --load {copy / 'iter_0000002'} to evaluate that older one")
    assert not (tmp_path / "r.json").exists()


def test_an_error_of_every_rank_is_said_once_under_nproc_per_node(run, tmp_path):
    """Both ranks refuse the older checkpoint after the process group exists: rank 0 says it, rank 1 reads rank 0's
    outcome from the launcher's store and stays silent (no clock decides; before, rank 1 added its own line)."""
    import shutil

    config, save = run
    copy = tmp_path / "run"
    shutil.copytree(save, copy)
    data = copy / "iter_0000004" / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:1000])
    out = eval_long("--config", config, "--load", copy, "--out", tmp_path / "r.json", "--lengths", "--documents", "2",
                    "--nproc-per-node", "2")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert [ln for ln in out.stderr.splitlines() if "error:" in ln] == [
        f"error: the newest checkpoint {copy / 'iter_0000004'} does not load, and eval_long evaluates only the "
        f"newest: pass --load {copy / 'iter_0000002'} to evaluate that older one"], out.stderr[-2000:]


def test_rank_1_failing_first_stays_silent(run, tmp_path):
    """Rank 1 reaches the error (a passkey length past data.seq_length) before rank 0 (a test hook orders them with a
    marker file): rank 1 waits for rank 0's outcome in the launcher's store, finds the same line and stays silent."""
    config, save = run
    cmd = [sys.executable, "-m", "tests.support.launch_driver", "2", f"eval_rank1_fails_first:{tmp_path / 'rank1'}",
           "eval_long", "--config", str(config), "--load", str(save), "--out", str(tmp_path / "r.json"),
           "--documents", "0", "--lengths", "4096"]
    out = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    lines = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "4096" in lines[0], out.stderr[-2000:]
    assert (tmp_path / "rank1").exists()


def test_passkey_prompt_through_a_hugging_face_tokenizer(tmp_path):
    tok = HuggingFaceTokenizer(llama3_tokenizer(tmp_path / "tok"))
    prompt = PasskeyPrompt.from_tokenizer(tok, "tok")
    assert prompt.source == "huggingface tok"
    s = prompt.build(200, 0.5, "71432", 256)
    text = tok.decode(s.tokens[:201].tolist())
    assert text.startswith("There is an important") and text.endswith("What is the pass key? The pass key is 71432")
    assert "The pass key is 71432. Remember it." in text
    assert tok.decode(list(s.answer)).strip() == "71432" and s.answer_positions[-1] == 199
    assert max(s.tokens.tolist()) < tok.vocab_size  # text tokens, not digit ids
