import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_configure(config):
    config.addinivalue_line("markers", "ortools: needs OR-Tools (the planning extra); skipped without it, run by "
                                       ".ci/run after installing the extra (pytest -m ortools)")


def pytest_collection_modifyitems(config, items):
    import importlib.util

    import pytest

    if importlib.util.find_spec("ortools") is None:
        skip = pytest.mark.skip(reason="OR-Tools is not installed (pip install -e '.[planning]')")
        for item in items:
            if "ortools" in item.keywords:
                item.add_marker(skip)
