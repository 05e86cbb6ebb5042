"""Long-context evaluation (megatron_lc/training/eval/by_position.py + passkey.py, tools/eval_long.py): per-token losses
under ring, Ulysses, FPDT and tp with SP equal the single-process forward; the argmax of chosen positions equals
the full logits'; a model made to know a passkey is scored right and another key wrong, single-process and parallel;
bucket edges and counts; the command line end to end (one process and torchrun cp=2, same numbers) and a bad --load."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron_lc.config import ConfigError, resolve_layout
from megatron_lc.data.tokenizer import SentencePieceTokenizer
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.eval.by_position import (PositionLoss, bucket_edges, context_positions, default_bucket_edges,
                                                   predict_tokens, vocab_parallel_argmax)
from megatron_lc.training.eval.passkey import PasskeyPrompt, passkey_batch, passkey_key
from megatron_lc.training.loop import Trainer
from tests.dist_cases import eval as cases
from tests.support.dist import run_dist
from tests.dist_cases.cp import cp_overrides
from tests.support.parity import LOSS_RTOL, batch_for, build, small_config

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DEMO_TOKENIZER = os.path.join(ROOT, "data/demo/stdlib_py_sp8000.model")

LAYOUTS = {  # world 2 each
    "ring-cp2": cp_overrides("p2p", 2),
    "ulysses-cp2": cp_overrides("a2a", 2),
    "tp2-sp": cp_overrides("p2p", 1, tp=2) + ["parallel.sequence_parallel=true"],
    "fpdt-cp2": cp_overrides("fpdt", 2) + ["memory.fpdt_chunk_size=8"],  # strided chunks, 4 per rank
}


@pytest.fixture(scope="module")
def bigram():
    """(full weights that know the key of ``known`` seed, known seed, other seed)."""
    known, other = cases.known_key_seeds()
    p = cases.PASSKEY
    return cases.bigram_state(small_config(), passkey_key(known, p["length"], p["depth"], 0, p["digits"])), known, other


@pytest.fixture(scope="module")
def layout_results(bigram):
    """Each layout run once (2 gloo ranks), its results shared by the tests below."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run_dist(2, cases.layout_case, LAYOUTS[name], *bigram)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_token_losses_in_global_order_equal_single_process(name, layout_results):
    for r in layout_results(name):
        got, ref = r["losses"], r["ref_losses"]
        assert got.shape == ref.shape == (2, 32)
        rel = ((got - ref).abs() / ref.abs()).max().item()
        assert rel <= LOSS_RTOL, f"{name}: per-token loss max relative diff {rel:.3e}"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_argmax_at_chosen_positions_equals_full_logits(name, layout_results):
    for r in layout_results(name):
        assert torch.equal(r["pred"], r["ref_pred"]), (r["pred"], r["ref_pred"])


@pytest.mark.parametrize("name", ["ring-cp2", "tp2-sp"])
def test_passkey_scored_under_parallel_layouts(name, layout_results):
    for r in layout_results(name):
        assert r["known"] == (1.0, 1.0)
        assert r["other"][0] == 0.0 and r["other"][1] < 1.0


def test_passkey_scored_right_for_a_model_that_knows_it(bigram):
    """The bigram model (dist_cases_eval.bigram_state) predicts its key at every answer token; another key (other
    first digit) is not retrieved. Also read the predictions directly: they are the known key's tokens."""
    state, known, other = bigram
    cfg = small_config()
    layout, topo = resolve_layout(cfg, 1), Topology()
    model = build(cfg)[0]
    cases.load_full_state(model, state, topo)
    assert cases.passkey_accuracy(model, cfg, layout, topo, known) == (1.0, 1.0)
    exact, tokens = cases.passkey_accuracy(model, cfg, layout, topo, other)
    assert exact == 0.0 and tokens < 1.0
    p = cases.PASSKEY
    key = passkey_key(known, p["length"], p["depth"], 0, p["digits"])
    prompt = PasskeyPrompt.token_ids(cfg.model.vocab_size)
    sample = prompt.build(p["length"], p["depth"], key, cfg.data.seq_length)
    batch, positions, answers = passkey_batch([sample], torch.device("cpu"))
    pred = predict_tokens(model, batch, positions, layout, topo, cfg.model.vocab_size)
    assert pred.tolist() == [[int(c) for c in key]] == answers.tolist()


def test_head_on_final_hidden_states_is_the_model_logits():
    """``GPTModel.final_hidden_states`` is what the head reads: the head on it gives the model's logits."""
    cfg = small_config()
    model = build(cfg)[0]
    b = batch_for(cfg)
    with torch.no_grad():
        want = model(b["tokens"], b["position_ids"])  # [b, s, V]
        h = model.final_hidden_states(b["tokens"], b["position_ids"])  # [s, b, h]
        got = F.linear(model.head.gather_input(h), model.head.weight).transpose(0, 1)
    assert torch.equal(got, want)


def test_vocab_parallel_argmax_skips_padding_and_takes_the_first_of_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 9.0, 9.0],  # ids 4, 5: padding of a vocabulary of 4
                           [2.0, 0.0, 2.0, 0.0, 0.0, 0.0]])
    assert vocab_parallel_argmax(logits, Topology(), 4).tolist() == [1, 0]


def test_passkey_prompt_token_ids():
    """The docstring's example: length 24, depth 0.5, key 42 -> 8 filler, needle, 8 filler, question, key; then
    filler to the sequence length. Out-of-range inputs are one-line errors."""
    prompt = PasskeyPrompt.token_ids(256)
    s = prompt.build(24, 0.5, "42", 32)
    assert s.tokens.tolist()[:25] == [*range(16, 24), 10, 11, 4, 2, 12, *range(24, 32), 13, 14, 4, 2]
    assert len(s.tokens) == 33 and s.answer_positions == (22, 23) and s.answer == (4, 2) and s.needle_position == 8
    assert s.tokens[1:][list(s.answer_positions)].tolist() == [4, 2]  # the labels of the answer positions
    assert prompt.build(24, 0.0, "42", 24).needle_position == 0
    assert prompt.build(24, 1.0, "42", 24).tokens.tolist()[16:21] == [10, 11, 4, 2, 12]
    for args, msg in [((40, 0.5, "42", 32), "exceeds data.seq_length"), ((7, 0.5, "42", 32), "shorter than"),
                      ((24, 1.5, "42", 32), "must be in")]:
        with pytest.raises(ConfigError, match=msg):
            prompt.build(*args)
    with pytest.raises(ConfigError, match="must be larger"):
        PasskeyPrompt.token_ids(64)


@pytest.mark.skipif(not os.path.isfile(DEMO_TOKENIZER), reason="the demo tokenizer is built by the demo run")
def test_passkey_prompt_sentencepiece():
    tok = SentencePieceTokenizer(DEMO_TOKENIZER)
    prompt = PasskeyPrompt.from_tokenizer(tok, DEMO_TOKENIZER)
    s = prompt.build(200, 0.5, "71432", 256)
    text = tok.decode(s.tokens[:201].tolist())
    assert text.startswith("There is an important") and text.endswith("What is the pass key? The pass key is 71432")
    assert "The pass key is 71432" in text[:-20] and tok.decode(list(s.answer)) == "71432"
    assert len(s.answer) == 5  # the word-boundary piece before the digits is not scored
    assert s.answer_positions == tuple(range(195, 200))


def test_bucket_edges():
    assert default_bucket_edges(32) == [0, 32]
    assert default_bucket_edges(1024) == [0, 1024]
    assert default_bucket_edges(1025) == [0, 1024, 1025]
    assert default_bucket_edges(2**20) == [0, 1024, 4096, 16384, 65536, 262144, 2**20]
    assert bucket_edges(100, [0, 10, 50, 200]) == [0, 10, 50, 100]
    assert bucket_edges(100) == [0, 100]
    for bad in ([5, 10], [0, 10, 10], []):
        with pytest.raises(ConfigError, match="must start at 0"):
            bucket_edges(100, bad)


def test_position_loss_counts_and_means():
    """Losses 0..9 at positions 0..9 of two rows, edges 0 4 10; row 1's token 5 masked out; dp of 1 ranks."""
    acc = PositionLoss([0, 4, 10])
    loss = torch.arange(10.0).expand(2, 10)
    mask = torch.ones(2, 10)
    mask[1, 5] = 0
    acc.add(loss, mask, torch.arange(10).expand(2, 10))
    acc.reduce(Topology(), torch.device("cpu"))
    out = acc.summary()
    assert [(b["start"], b["end"], b["tokens"]) for b in out["buckets"]] == [(0, 4, 8), (4, 10, 11)]
    assert out["buckets"][0]["mean_loss"] == pytest.approx(1.5)  # (0+1+2+3) * 2 / 8
    assert out["buckets"][1]["mean_loss"] == pytest.approx((2 * 39 - 5) / 11)
    assert out["tokens"] == 19 and out["mean_loss"] == pytest.approx((2 * 45 - 5) / 19)
    assert PositionLoss([0, 4, 10]).summary()["buckets"][0]["mean_loss"] is None  # empty: no number


def test_context_positions_restart_per_document():
    batch = {"tokens": torch.zeros(2, 6, dtype=torch.long)}
    assert context_positions(batch).tolist() == [list(range(6))] * 2
    batch["document_ids"] = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])
    assert context_positions(batch).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]


# ---- the command line --------------------------------------------------------------------------------------------
def summary_lines(results: dict) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import eval_long

    return eval_long.summary_lines(results)


def eval_cli(*args, nproc: int = 1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
                if nproc > 1 else [sys.executable])
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(launcher + ["tools/eval_long.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """2 training steps of the small model on mock data; (config path, save dir)."""
    d = tmp_path_factory.mktemp("eval")
    cfg = small_config([f"checkpoint.save={d}/run", "train.train_iters=2", "train.global_batch_size=2",
                        "logging.peak_tflops=1"])
    Trainer(cfg, Topology()).train()
    raw = cfg.to_dict()
    raw["checkpoint"]["save"] = None
    with open(d / "config.yaml", "w") as f:
        yaml.safe_dump(raw, f)
    return str(d / "config.yaml"), str(d / "run")


def test_cli_writes_json_and_png_and_two_ranks_give_the_same_numbers(tiny_checkpoint, tmp_path):
    config, run = tiny_checkpoint
    common = ["--config", config, "--load", run, "--documents", "3", "--bucket-edges", "0", "8", "16",
              "--lengths", "24", "32", "--depths", "0", "0.5", "1", "--trials", "2"]
    png = importlib.util.find_spec("matplotlib") is not None
    one = eval_cli(*common, "--out", str(tmp_path / "one.json"), *(["--png", str(tmp_path / "one.png")] * png))
    assert one.returncode == 0, one.stderr[-3000:]
    res = json.loads((tmp_path / "one.json").read_text())
    # the terminal gets the summary (buckets' means, keys right per length); the JSON goes to --out alone
    summary = summary_lines(res)
    assert one.stdout.splitlines() == [*summary, f"wrote {tmp_path / 'one.json'}"
                                       + (f" and {tmp_path / 'one.png'}" if png else "") + " (the full results)"]
    assert [ln.split()[0] for ln in summary] == ["evaluated", "loss", "0-8", "8-16", "16-32", "passkey,", "24", "32"]
    keys = [round(sum(row) * 2) for row in res["passkey"]["accuracy"]]  # 3 depths x 2 keys per length
    assert summary[-2:] == [f"  {n:<12} {k} of 6 ({100 * k / 6:.0f}%)" for n, k in zip((24, 32), keys)]
    assert res["iteration"] == 2 and res["checkpoint"].endswith("iter_0000002") and res["seq_length"] == 32
    pl = res["position_loss"]
    assert pl["samples"] == 3 and pl["source"] == "mock data" and pl["seen_in_training"] is False
    assert [(b["start"], b["end"], b["tokens"]) for b in pl["buckets"]] == [(0, 8, 24), (8, 16, 24), (16, 32, 48)]
    assert all(4.0 < b["mean_loss"] < 7.0 for b in pl["buckets"])  # ~log(256) = 5.5 after 2 steps
    pk = res["passkey"]
    assert pk["prompt"] == "token ids" and pk["lengths"] == [24, 32] and pk["depths"] == [0.0, 0.5, 1.0]
    assert len(pk["accuracy"]) == 2 and all(len(row) == 3 for row in pk["accuracy"] + pk["token_accuracy"])
    assert [(c["length"], c["depth"]) for c in pk["cells"]] == [(n, d) for n in (24, 32) for d in (0.0, 0.5, 1.0)]
    if png:
        with open(tmp_path / "one.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    # two ranks: ring cp=2; dp=2 (3 samples and 12 prompts split unevenly, sums added over dp)
    for name, sets in (("cp", ["--set", "parallel.context_parallel_size=2"]), ("dp", [])):
        two = eval_cli(*common, *sets, "--out", str(tmp_path / f"{name}.json"), nproc=2)
        assert two.returncode == 0, two.stderr[-3000:]
        res2 = json.loads((tmp_path / f"{name}.json").read_text())
        assert res2["layout"][name] == 2 and res2["position_loss"]["sample_ids"] == pl["sample_ids"]
        for a, b in zip(res2["position_loss"]["buckets"], pl["buckets"]):
            assert a["tokens"] == b["tokens"] and abs(a["mean_loss"] - b["mean_loss"]) <= LOSS_RTOL * b["mean_loss"]
        assert res2["passkey"]["cells"] == pk["cells"]


def test_cli_without_out_prints_the_summary_and_says_where_the_json_could_go(tiny_checkpoint, tmp_path):
    config, run = tiny_checkpoint
    out = eval_cli("--config", config, "--load", run, "--documents", "1", "--bucket-edges", "0", "16", "--lengths",
                   "32", "--depths", "0.5")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 7 and lines[0].startswith("evaluated ") and lines[1].startswith("loss by position (1 ")
    assert lines[-1] == ("the full results (every bucket's tokens, every passkey cell, token accuracies) were not "
                         "written: add --out FILE.json")
    assert "{" not in out.stdout


def test_cli_missing_checkpoint_is_one_line(tiny_checkpoint, tmp_path):
    config, _ = tiny_checkpoint
    out = eval_cli("--config", config, "--load", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.json"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert [ln for ln in out.stderr.splitlines() if "error" in ln.lower()] == [
        f"error: --load {tmp_path / 'nowhere'}: no such directory"]
    assert not (tmp_path / "r.json").exists()
