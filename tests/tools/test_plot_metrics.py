"""tools/plot_metrics.py turns a real metrics.jsonl (from a short training run) into a PNG with the four panels."""
import json
import os
import sys

from megatron_lc.parallel.topology import Topology
from megatron_lc.training.loop import Trainer
from tests.support.parity import small_config

sys.path.insert(0, os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), "tools"))
import plot_metrics  # noqa: E402


def test_png_from_a_real_run_with_a_resumed_tail(tmp_path):
    mfile = tmp_path / "run" / "metrics.jsonl"
    Trainer(small_config(["train.train_iters=4", f"logging.metrics_file={mfile}"]), Topology()).train()
    recs = [json.loads(line) for line in mfile.read_text().splitlines()]
    assert {"loss", "tokens_per_s", "mfu", "peak_memory_bytes"} <= set(recs[0])
    # a resumed run appends steps 3, 4 again (the later ones count), and a kill cut the last line
    with open(mfile, "a") as f:
        for r in recs[2:]:
            f.write(json.dumps(dict(r, loss=r["loss"] + 1.0, skipped=r["step"] == 4)) + "\n")
        f.write('{"step": 5, "lo')
    merged = plot_metrics.read_metrics(str(mfile))
    assert [r["step"] for r in merged] == [1, 2, 3, 4]
    assert merged[3]["loss"] == recs[3]["loss"] + 1.0 and merged[3]["skipped"]
    out = tmp_path / "m.png"
    assert plot_metrics.main([str(mfile), str(mfile), "--label", "a", "--label", "b", "-o", str(out),
                              "--smooth", "2"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_missing_file_is_a_one_line_error(tmp_path, capsys):
    assert plot_metrics.main([str(tmp_path / "nope.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope.jsonl'} not found"


def test_without_o_the_png_goes_beside_the_metrics_file_and_its_path_is_printed(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s, "tokens_per_s": 100.0,
                                                           "mfu": 0.1, "peak_memory_bytes": 2**20}) + "\n"
                                               for s in (1, 2, 3)))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the current folder: no PNG lands here
    assert plot_metrics.main([str(run / "metrics.jsonl")]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {run / 'metrics.png'} (3 steps)"
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert os.listdir(tmp_path / "elsewhere") == []
