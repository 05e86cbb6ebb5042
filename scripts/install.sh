#!/usr/bin/env bash
# Create .venv and install megatron_lc with its test tools, CPU build of PyTorch first.
#   bash scripts/install.sh            (idempotent; re-running only checks what is installed)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first and pinned: this resolves to the CPU wheel on this disk; an unpinned torch would be a CUDA build.
.venv/bin/pip install --disable-pip-version-check --progress-bar on torch==2.13.0
.venv/bin/pip install --disable-pip-version-check --progress-bar on -e ".[dev]"
.venv/bin/python -c "import torch, megatron_lc; print('installed: torch', torch.__version__, '| megatron_lc', megatron_lc.__version__)"
