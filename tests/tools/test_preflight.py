"""tools/preflight.py: every API the code calls, checked before a job books GPUs; one line naming what is missing."""
import os
import sys
import types

import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import preflight  # noqa: E402  (a script of tools/)


def run(capsys, *argv):
    code = preflight.main(list(argv))
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 1, out.out
    return code, lines[0], out.err


def test_this_machines_torch_has_every_api(capsys):
    code, line, _ = run(capsys)
    assert code == 0 and line.endswith("every API the code calls is present"), line
    assert "flash-attn absent (optional)" in line and "te absent (optional)" in line


def test_a_missing_method_and_a_missing_keyword_are_named_in_one_line(capsys, monkeypatch):
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    monkeypatch.setattr(dcp, "save", lambda state_dict, *, checkpoint_id=None, storage_writer=None: None)
    code, line, _ = run(capsys)
    assert code == 1 and line.startswith("preflight: missing: "), line
    assert "torch.distributed.fsdp.FSDPModule.set_force_sum_reduction_for_comms (FSDP2's gradient SUM" in line
    assert "torch.distributed.checkpoint.save(no_dist=) (checkpoints)" in line


def test_optional_libraries_are_checked_when_installed_and_required_on_request(capsys, monkeypatch):
    code, line, _ = run(capsys, "--require", "flash-attn")
    assert code == 1 and "flash_attn (flash-attn is required and not installed)" in line, line
    fa = types.ModuleType("flash_attn")
    fa.__version__ = "2.5.0"
    fa.flash_attn_interface = types.SimpleNamespace(_flash_attn_forward=lambda q, k, v, dropout_p, softmax_scale,
                                                    causal, window_size: None)  # before window_size_left
    monkeypatch.setitem(sys.modules, "flash_attn", fa)
    code, line, _ = run(capsys)
    assert code == 1 and "flash-attn 2.5.0" in line, line
    assert "flash_attn.flash_attn_interface._flash_attn_forward(window_size_left, window_size_right, softcap, " \
           "alibi_slopes, return_softmax=)" in line, line
    assert "flash_attn.flash_attn_interface._flash_attn_backward (" in line, line


def test_bad_input_is_one_line(capsys):
    assert preflight.main(["--require", "apex"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --require 'apex': unknown apex (known: flash-attn, te, fa3, fa4)"]
