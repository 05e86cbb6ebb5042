#!/usr/bin/env bash
# Create .venv and install megatron_lc with its test tools, CPU build of PyTorch first.
#   bash scripts/install.sh            (idempotent; re-running only checks what is installed)
# pip runs quietly (-qq: its errors still show, not the warnings of a machine's own pip configuration); one line says
# what is being done, one what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then
  echo "checking .venv: torch 2.13.0 (CPU build), megatron_lc and its test tools"
else
  echo "installing into .venv: torch 2.13.0 (CPU build), megatron_lc and its test tools (about a minute, quietly)"
  "$PY" -m venv .venv
fi
# torch first and pinned: this resolves to the CPU wheel on this disk; an unpinned torch would be a CUDA build.
.venv/bin/pip install -qq --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -qq --disable-pip-version-check -e ".[dev]"
.venv/bin/python -c "import torch, megatron_lc; print('installed: torch', torch.__version__, '| megatron_lc', megatron_lc.__version__)"
