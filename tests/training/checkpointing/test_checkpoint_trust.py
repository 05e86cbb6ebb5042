"""A checkpoint is data (training/checkpointing/data_only.py): files crafted to run code when unpickled -- a
``.metadata``,
an RNG file, a ``.metadata`` that routes a piece through ``torch.load(weights_only=False)`` -- are refused on
resume and by the tools, and their payload never runs. Each crafted file is first shown to run its payload when
unpickled the way torch does by default, so a refusal is not a payload that would have failed anyway."""
from __future__ import annotations

import io
import json
import logging
import os
import pickle
import random
import shutil
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from megatron_lc.config import ConfigError
from megatron_lc.parallel.topology import Topology
from megatron_lc.training.checkpointing.load import file_digest
from megatron_lc.training.checkpointing.data_only import UntrustedCheckpointError, rng_state, set_rng_state
from megatron_lc.training.loop import Trainer
from tests.support.parity import small_config
from tests.repo.test_nothing_silent import ROOT, TINY, assert_one_error, pretrain

sys.path.insert(0, os.path.join(ROOT, "tools"))


class Payload:
    """Unpickling it writes ``marker`` (what a planted checkpoint file would do, harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 2-step run saved once; each test copies it."""
    d = tmp_path_factory.mktemp("saved")
    Trainer(small_config(TINY + ["train.train_iters=2", f"checkpoint.save={d / 'run'}",
                                 f"logging.metrics_file={d / 'm.jsonl'}"]), Topology()).train()
    return d / "run"


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def _replace(ckpt, name: str, data: bytes) -> None:
    """Write ``name`` into ``ckpt`` and list it in meta.json as an attacker would (the checksums do not help)."""
    (ckpt / name).write_bytes(data)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][name] = file_digest(str(ckpt / name))
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _planted_metadata(ckpt, marker) -> None:
    """The real metadata with a payload riding along: a plain ``pickle.load`` runs it and returns good metadata."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    md.planner_data = {"x": Payload(marker)}
    _replace(ckpt, ".metadata", pickle.dumps(md))


def _bytes_entry_metadata(ckpt, marker) -> None:
    """Metadata of allowed DCP classes only, one entry marked as bytes: DCP reads that piece with
    ``torch.load(weights_only=False)``, and the piece is a pickled payload appended to the data file."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    data = ckpt / "__0_0.distcp"
    offset = data.stat().st_size
    _replace(ckpt, "__0_0.distcp", data.read_bytes() + buf.getvalue())
    key = "model/final_layernorm.weight"
    md.state_dict_metadata[key] = BytesStorageMetadata()
    md.storage_data[MetadataIndex(key)] = _StorageInfo("__0_0.distcp", offset, len(buf.getvalue()))
    _replace(ckpt, ".metadata", pickle.dumps(md))


def _planted_rng(ckpt, marker) -> None:
    buf = io.BytesIO()
    torch.save({**rng_state(), "python": Payload(marker)}, buf)
    _replace(ckpt, "rng_rank00000.pt", buf.getvalue())


def _resume(run, *extra):
    return Trainer(small_config(TINY + ["train.train_iters=3", f"checkpoint.save={run}", f"checkpoint.load={run}",
                                        f"logging.metrics_file={run / 'r.jsonl'}", *extra]), Topology())


def test_crafted_files_do_run_code_when_unpickled_as_torch_does_by_default(saved, tmp_path):
    """The payloads are real: DCP's own reader and ``torch.load(weights_only=False)`` run them."""
    target = {"model/final_layernorm.weight": torch.empty(64)}
    for n, (craft, load) in enumerate([
            (_planted_metadata, lambda c: FileSystemReader(str(c)).read_metadata()),
            (_bytes_entry_metadata, lambda c: dcp.load(target, storage_reader=FileSystemReader(str(c)), no_dist=True)),
            (_planted_rng, lambda c: torch.load(c / "rng_rank00000.pt", weights_only=False))]):
        ckpt, marker = tmp_path / f"c{n}", tmp_path / f"ran{n}"
        shutil.copytree(saved / "iter_0000002", ckpt)
        craft(ckpt, marker)
        load(ckpt)
        assert marker.read_text() == "ran"


@pytest.mark.parametrize("craft, name", [(_planted_metadata, ".metadata"), (_bytes_entry_metadata, ".metadata"),
                                         (_planted_rng, "rng_rank00000.pt")])
def test_resume_refuses_a_crafted_file_and_runs_nothing(run, tmp_path, craft, name):
    marker = tmp_path / "ran"
    craft(run / "iter_0000002", marker)
    with pytest.raises(UntrustedCheckpointError) as e:
        _resume(run)
    assert not marker.exists()
    msg = str(e.value)
    assert msg.startswith(f"{run / 'iter_0000002' / name} ") and "\n" not in msg
    assert "refused, since unpickling it could run code" in msg and msg.endswith(
        "; set checkpoint.trust_pickle: true to load it anyway, only for a checkpoint you trust")


def test_refusal_is_one_line_and_never_falls_back_to_an_older_checkpoint(tmp_path):
    """Through pretrain_gpt.py: exit 2, one line, no traceback; a planted file is not damage, so the run does not
    quietly resume from an older checkpoint."""
    run = tmp_path / "run"
    out = pretrain(*TINY, "train.train_iters=2", "checkpoint.save_interval=1", f"checkpoint.save={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    marker = tmp_path / "ran"
    _planted_metadata(run / "iter_0000002", marker)
    out = pretrain(*TINY, "train.train_iters=3", f"checkpoint.save={run}", f"checkpoint.load={run}")
    meta = run / "iter_0000002" / ".metadata"
    assert_one_error(out, f"{meta} is not a checkpoint's metadata as data (it asks for builtins.exec, which is not "
                          f"part of a checkpoint's metadata): refused, since unpickling it could run code; set "
                          f"checkpoint.trust_pickle: true to load it anyway, only for a checkpoint you trust")
    assert not marker.exists() and not (run / "iter_0000003").exists()


def test_convert_to_hf_refuses_a_crafted_metadata(run, tmp_path, capsys):
    import convert_to_hf

    marker = tmp_path / "ran"
    _bytes_entry_metadata(run / "iter_0000002", marker)
    assert convert_to_hf.main([str(run), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {run / 'iter_0000002' / '.metadata'} is not a checkpoint's metadata as data (it "
                          f"asks for torch.distributed.checkpoint.metadata.BytesStorageMetadata") and err.count("\n") == 1
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_eval_long_refuses_a_crafted_metadata(run, tmp_path, capsys):
    import eval_long

    marker = tmp_path / "ran"
    _planted_metadata(run / "iter_0000002", marker)
    sets = [a for s in TINY for a in ("--set", s)]
    code = eval_long.main(["--config", "configs/tiny_cpu.yaml", *sets, "--load", str(run), "--out",
                           str(tmp_path / "e.json"), "--lengths", "--documents", "1"])
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1 and err[0].startswith(f"error: {run / 'iter_0000002' / '.metadata'} is not a checkpoint's")
    assert not marker.exists()


def test_older_rng_file_is_refused_naming_it_unless_trusted(run, caplog):
    """An RNG file of the earlier format (Python tuples and numpy arrays, pickled) needs numpy's classes: one line;
    ``checkpoint.trust_pickle: true`` loads it, said in the log."""
    rng = run / "iter_0000002" / "rng_rank00000.pt"
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    buf = io.BytesIO()
    torch.save(old, buf)
    _replace(run / "iter_0000002", "rng_rank00000.pt", buf.getvalue())
    with pytest.raises(ConfigError, match=rf"^{rng} holds pickled Python objects, not only tensors \(.*numpy"):
        _resume(run)
    caplog.set_level(logging.WARNING, logger="megatron_lc")
    assert _resume(run, "checkpoint.trust_pickle=true").state.iteration == 2
    assert f"{rng}: unpickled without restrictions (checkpoint.trust_pickle: true)" in caplog.text


def test_megatron_core_safe_globals_do_not_let_an_older_rng_file_through(run):
    """Importing megatron-core's datasets or tokenizers (every real-data run) adds numpy arrays to torch's global list
    of safe types; a checkpoint is still read with torch's own types only."""
    with warnings.catch_warnings():  # megatron-core warns that TE/apex are absent on CPU machines
        warnings.simplefilter("ignore")
        from megatron.core.safe_globals import register_safe_globals

    register_safe_globals()
    rng = run / "iter_0000002" / "rng_rank00000.pt"
    buf = io.BytesIO()
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, buf)
    _replace(run / "iter_0000002", "rng_rank00000.pt", buf.getvalue())
    with pytest.raises(ConfigError, match=rf"^{rng} holds pickled Python objects, not only tensors"):
        _resume(run)
    assert np.ndarray in torch.serialization.get_safe_globals()  # put back after the load


def test_rng_states_round_trip_as_tensors(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.gauss(0, 1), np.random.standard_normal()  # cached gaussians are part of the state
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
            torch.rand(3).tolist())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.standard_normal(),
            torch.rand(3).tolist()) == want
