"""``tools/cp_layout.py`` prints what the trainer does: each cp rank's tokens are those of the trainer's shard of the
same micro-batch (``training/batches.microbatches``: the data path's mock documents, ``shard_batch``), for the
balanced ring, the zigzag, the hybrid and Ulysses; its bytes are the plan's; bad input is one line."""
from __future__ import annotations

import json

import pytest
import torch

from megatron_lc.config import load_config, resolve_layout
from megatron_lc.data import build_dataset
from megatron_lc.parallel.token_layout import shard_batch
from megatron_lc.parallel.topology import Topology
from megatron_lc.rehearsal.report import attention_balance
from megatron_lc.training.batches import microbatches
from tools import cp_layout

BASE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=8", "model.num_query_groups=4",
        "model.ffn_hidden_size=128", "model.vocab_size=256", "model.make_vocab_size_divisible_by=64",
        "data.seq_length=256", "data.mock_data=true", "data.mean_document_length=48",
        "data.reset_attention_mask=true", "train.micro_batch_size=1", "train.device=cpu"]
LAYOUTS = {"balanced": ["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p"],
           "zigzag": ["parallel.context_parallel_size=4", "parallel.cp_comm_type=p2p", "parallel.cp_layout=zigzag"],
           "hybrid": ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a+p2p", "parallel.ulysses_size=2"],
           "ulysses": ["parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a"]}


def _printed(capsys, over, *extra):
    args = ["--config", "configs/tiny_cpu.yaml"] + [a for o in BASE + over for a in ("--set", o)] + list(extra)
    assert cp_layout.main(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_each_rank_prints_the_tokens_of_the_trainers_shard(name, capsys):
    over = LAYOUTS[name]
    out = _printed(capsys, over, "--sample", "1")
    cfg = load_config("configs/tiny_cpu.yaml", BASE + over)
    layout = resolve_layout(cfg, 4)
    data = build_dataset(cfg, [4, 0, 0]).train
    for c, rank in enumerate(out["ranks"]):
        topo = Topology(world_size=4, rank=c, cp=4, ulysses=layout.ulysses)
        batch = microbatches(cfg, layout, topo, data, 1, torch.device("cpu"))[0]  # step 2: sample 1
        held = torch.arange(256).unsqueeze(0)  # the global positions, sharded as the tokens are
        pos = shard_batch({"tokens": held, "documents": batch["documents"]}, layout, topo)["tokens"][0].tolist()
        assert [t for a, b in rank["tokens"] for t in range(a, b)] == pos, (name, c)
    assert out["summary"]["cp_layout"] == ("zigzag" if name in ("zigzag", "ulysses") else "balanced")
    if name == "balanced":
        assert out["summary"]["pairs_slowest_over_mean"] < _printed(capsys, LAYOUTS["zigzag"], "--sample", "1")[
            "summary"]["pairs_slowest_over_mean"]
    if name == "ulysses":
        assert all(r["kv_received_bytes_per_layer"] == 0 for r in out["ranks"])


def test_documents_from_a_file_and_bad_input(tmp_path, capsys):
    f = tmp_path / "lengths.json"
    f.write_text(json.dumps([100, 100, 56]))
    out = _printed(capsys, LAYOUTS["balanced"], "--documents", str(f))
    # ring of 4, 64 tokens each; fp32 on the CPU: a received row is 2 x 4 kv heads x 8 dims x 4 bytes
    assert all(r["kv_received_bytes_per_layer"] % (2 * 4 * 8 * 4) == 0 for r in out["ranks"])
    f.write_text(json.dumps([100, 100]))
    args = ["--config", "configs/tiny_cpu.yaml"] + [a for o in BASE + LAYOUTS["balanced"] for a in ("--set", o)]
    assert cp_layout.main(args + ["--documents", str(f)]) == 2
    err = capsys.readouterr().err
    assert "summing to data.seq_length (256)" in err and err.count("\n") == 1
    assert cp_layout.main(args + ["--documents", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_rehearsals_balance_line_is_for_a_ring_only():
    """Ulysses splits heads: every rank runs the whole sequence's pairs and its ring attention counts none, so the
    rehearsal's line beside this tool's figures is left out (it printed "pairs 100.0%" off at 4M under Ulysses);
    the ring's figures stay."""
    counted = {"attention": {"pairs_per_step": 0, "kv_received_bytes_per_step": {"p2p_fwd": 0, "p2p_bwd": 0}}}
    ulysses = load_config("configs/tiny_cpu.yaml", BASE + LAYOUTS["ulysses"])
    assert attention_balance(ulysses, 4, {0: counted}, 2) == {}
    ring = load_config("configs/tiny_cpu.yaml", BASE + LAYOUTS["balanced"])
    assert set(attention_balance(ring, 4, {0: counted}, 2)["ranks"]) == {0}
