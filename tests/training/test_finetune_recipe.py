"""The fine-tuning recipe of docs/finetune.md, run as written: its bash block (import a chat model with its template,
preprocess conversations with ``--chat``, fine-tune at cp 2 with ring attention, export, ``generate`` through the
template) in a fresh directory that links the repository's tools and configs (the stand-ins are a tool's); only the
interpreter and the stand-in model's directory are this test's. The exported model answers the fixed sentence it was
fine-tuned on, ends it with ``<|eot_id|>``, and the page's printed figures are what the run prints. The README's
section shows the same block.

Cost: seven commands, each a fresh interpreter (about 1 min on an idle 2-core machine, most of it imports)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PAGE = os.path.join(ROOT, "docs", "finetune.md")
STANDIN = "data/llama3_chat_tiny"  # the page's stand-in model directory (tools/stand_ins.py)
ANSWER = "'The answer is always the same sentence.<|eot_id|>'"


def recipe() -> str:
    """The bash block under "The recipe, as it ran"."""
    text = open(PAGE).read()
    section = text[text.index("## The recipe, as it ran"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def test_the_recipe_runs_as_written_and_the_export_answers(tmp_path):
    block = recipe()
    assert STANDIN in block and ".venv/bin/python" in block and ANSWER in open(PAGE).read()
    for name in ("tools", "configs", "pretrain_gpt.py"):  # not tests/: the recipe's stand-ins are a tool's
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    script = "set -euo pipefail\n" + block.replace(".venv/bin/python", sys.executable).replace(
        STANDIN, str(tmp_path / "hf"))
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", WANDB_MODE="disabled"))
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:])
    printed = out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == ANSWER, out.stdout[-2000:]
    assert '"documents": 2000' in printed and '"trained_tokens": 36000' in printed and '"too_long": 0' in printed
    valid = [float(v) for v in re.findall(r"valid loss ([0-9.]+)", printed)]
    assert len(valid) == 2 and valid[-1] < 0.2, valid  # the answers' loss, masked as in training
    assert (tmp_path / "runs" / "chat_ft_hf" / "chat_template.jinja").exists()


def test_the_readme_section_is_the_page_s_block():
    """README's "Fine-tune on long conversations", where it is, shows the commands this test runs, word for word."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    if "## Fine-tune on long conversations" not in readme:
        return  # the section links here; nothing to compare
    section = readme[readme.index("## Fine-tune on long conversations"):]
    assert re.search(r"```bash\n(.*?)```", section, re.S).group(1) == recipe()
