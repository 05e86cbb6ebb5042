"""What ``pip install .`` (not editable: the Docker image, a site-packages install) ships: every folder of the
package that holds modules is a package ``setup.py`` finds, and the planner's C sources (the replay, the exact
search's core) go with it."""
import os

from setuptools import find_packages

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_every_module_folder_is_an_installed_package():
    found = set(find_packages(ROOT, include=["megatron_lc", "megatron_lc.*"]))
    folders = {os.path.relpath(d, ROOT).replace(os.sep, ".")
               for d, _, files in os.walk(os.path.join(ROOT, "megatron_lc"))
               if "__pycache__" not in d and any(f.endswith(".py") for f in files)}
    assert folders - found == set(), f"folders with modules but no __init__.py (left out of a wheel): {folders - found}"


def test_the_c_sources_are_package_data():
    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_py = f.read()
    assert '"megatron_lc.planning": ["csrc/*.c"]' in setup_py
    assert '"megatron_lc.planning.solver": ["csrc/*.c", "csrc/*.h"]' in setup_py
    # the replay and the exact search's core (with its headers), both built on use
    for src in ("planning/csrc/plan_alloc.c", "planning/solver/csrc/dsa_search.c"):
        assert os.path.isfile(os.path.join(ROOT, "megatron_lc", *src.split("/")))


def test_the_gpu_extra_installs_with_plain_pip():
    """``pip install '.[gpu]'`` names only what pip installs as it is: no ``apex`` (on the package index an unrelated
    project, "Pyramid toolkit ..."), no ``flash-attn`` or TransformerEngine (built from source against the installed
    torch with ``--no-build-isolation``: docs/gpu.md says how and how long); FlashAttention-4 is Python."""
    import ast

    with open(os.path.join(ROOT, "setup.py")) as f:
        call = next(n for n in ast.walk(ast.parse(f.read())) if isinstance(n, ast.Call)
                    and getattr(n.func, "id", None) == "setup")
    extras = ast.literal_eval(next(k.value for k in call.keywords if k.arg == "extras_require"))
    assert extras["gpu"] == ["flash-attn-4"]
    with open(os.path.join(ROOT, "docs", "gpu.md")) as f:
        doc = f.read()
    assert "--no-build-isolation" in doc and "flash-attn" in doc and "transformer_engine" in doc
