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


# Cheap tests first, T5 (the longest-sequence search, which takes what is left of the time) last;
# scripts/gpu_check.sh runs the first four files within its loan-sized plan (PLAN), the rest when more time is lent.
ORDER = ["test_t1_backend", "test_t7_scratch", "test_t2_parity", "test_t3_copies", "test_t2_sync_bytes",
         "test_ranks_one_gpu", "test_t6_plan", "test_t4_profile", "test_t5_longest"]
PLAN = ORDER[:4]


def _rank(item) -> int:
    name = os.path.splitext(os.path.basename(str(item.fspath)))[0]
    return ORDER.index(name) if name in ORDER else len(ORDER)


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    mine = [i for i, item in enumerate(items) if str(item.fspath).startswith(here)]
    for i, item in zip(mine, sorted((items[i] for i in mine), key=_rank)):  # stable: order within a file kept
        items[i] = item
    if DEVICE is not None:
        return
    skip = pytest.mark.skip(reason="no CUDA device (scripts/gpu_check.sh; MEGATRON_LC_GPU_DRYRUN=1 runs the logic "
                                   "on the CPU)")
    for i in mine:
        items[i].add_marker(skip)


@pytest.fixture(scope="session")
def device():
    if DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity at the CPU tolerances
        torch.backends.cudnn.allow_tf32 = False
    return DEVICE


@pytest.fixture(scope="session")
def record():
    """``record(section, name, value)``: a figure for the JSON / markdown of the GPU check, written at once (a check
    the loan cuts off keeps every figure recorded before)."""
    def put(section: str, name: str, value) -> None:
        RESULTS.setdefault(section, {})[name] = value
        _write(None)
    return put


def _write(exitstatus) -> None:
    out = os.environ.get("GPU_CHECK_OUT")
    if not out or not RESULTS:
        return
    meta = {"device": torch.cuda.get_device_name(0) if DEVICE is not None and DEVICE.type == "cuda" else "cpu",
            "dryrun": DRYRUN, "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
            "pytest_exit": None if exitstatus is None else int(exitstatus)}
    with open(out + ".tmp", "w") as f:
        json.dump({"meta": meta, "results": RESULTS}, f, indent=1, default=str)
    os.replace(out + ".tmp", out)
    status = "still running" if exitstatus is None else f"pytest exit status {meta['pytest_exit']}"
    lines = [f"# GPU check: {meta['device']} (torch {meta['torch']}, CUDA {meta['cuda']})", "",
             f"{status}{' (dry run on CPU)' if DRYRUN else ''}", ""]
    for section, figures in RESULTS.items():
        lines += [f"## {section}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in figures.items()] + [""]
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write("\n".join(lines))


def pytest_sessionfinish(session, exitstatus):
    _write(exitstatus)
