"""The GPU check (``scripts/gpu_check.sh``): tests that need one CUDA device, skipped without one.

``MEGATRON_LC_GPU_DRYRUN=1`` runs their logic on the CPU instead (the fused CUDA kernels replaced by the CPU ones,
small shapes, no timing assertions): how they were checked on machines without a GPU. ``GPU_CHECK_OUT=path.json``
writes every figure the tests record to that file and a markdown summary beside it."""
import json
import os
import platform

import pytest
import torch

DRYRUN = os.environ.get("MEGATRON_LC_GPU_DRYRUN") == "1"
DEVICE = torch.device("cuda") if torch.cuda.is_available() else (torch.device("cpu") if DRYRUN else None)
RESULTS: dict = {}


def pytest_collection_modifyitems(config, items):
    if DEVICE is not None:
        return
    skip = pytest.mark.skip(reason="no CUDA device (scripts/gpu_check.sh; MEGATRON_LC_GPU_DRYRUN=1 runs the logic "
                                   "on the CPU)")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity at the CPU tolerances
        torch.backends.cudnn.allow_tf32 = False
    return DEVICE


@pytest.fixture
def record():
    """``record(section, name, value)``: a figure for the JSON / markdown of the GPU check."""
    def put(section: str, name: str, value) -> None:
        RESULTS.setdefault(section, {})[name] = value
    return put


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("GPU_CHECK_OUT")
    if not out or not RESULTS:
        return
    meta = {"device": torch.cuda.get_device_name(0) if DEVICE is not None and DEVICE.type == "cuda" else "cpu",
            "dryrun": DRYRUN, "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
            "pytest_exit": int(exitstatus)}
    with open(out, "w") as f:
        json.dump({"meta": meta, "results": RESULTS}, f, indent=1, default=str)
    lines = [f"# GPU check: {meta['device']} (torch {meta['torch']}, CUDA {meta['cuda']})", "",
             f"pytest exit status {meta['pytest_exit']}{' (dry run on CPU)' if DRYRUN else ''}", ""]
    for section, figures in RESULTS.items():
        lines += [f"## {section}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in figures.items()] + [""]
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("\n".join(lines))
