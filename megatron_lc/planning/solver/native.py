"""The exact search's C core (``csrc/dsa_search.c`` with its headers ``csrc/*.h``): built on first use with the system
C compiler into the user's cache, keyed by the sources' hash, and called through ctypes; ``search.py`` is the
reference and the fallback.

    lib = load()                  # None (and the reason in why_not()) when there is no compiler or the build fails
    code, offsets, nodes = fit_native(lib, prepared, capacity, (("WAT", True), ("WAT", False)), time_limit=10.0)

The library is ``$XDG_CACHE_HOME/megatron_lc/dsa_search-<sha256[:16]>.so`` (``~/.cache`` by default; a temporary
directory when that is not writable), e.g. ``~/.cache/megatron_lc/dsa_search-3f2a9c0e1b7d4a65.so``; an edited
source or header builds a new file. ``MEGATRON_LC_PLANNER_NATIVE=0`` forces the Python search; ``CC`` picks the compiler
(else ``cc``, then ``gcc``). Which search runs is logged once per process.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Optional

import numpy as np

from .sections import Prepared

log = logging.getLogger("megatron_lc")
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "dsa_search.c")
ENV = "MEGATRON_LC_PLANNER_NATIVE"
OK, FAIL, ABORT, NOMEM = 0, 1, 3, -1  # dsa_fit's answers
_state: dict = {}  # "lib" (CDLL or None), "why" (the reason it is None), "logged"


class NativeUnavailable(RuntimeError):
    """The C core cannot be used: no compiler, a failed build, or MEGATRON_LC_PLANNER_NATIVE=0."""


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatron_lc")


def build(src: str = SRC, out_dir: Optional[str] = None) -> str:
    """Compile ``src`` (with the headers beside it) to ``<out_dir>/dsa_search-<hash>.so`` unless it is there;
    returns its path. Written to a temporary name and renamed, so concurrent builds never load a half-written file."""
    here = os.path.dirname(os.path.abspath(src))
    digest = hashlib.sha256()
    for path in [src] + sorted(glob.glob(os.path.join(here, "*.h"))):
        with open(path, "rb") as f:
            digest.update(f.read())
    tag = digest.hexdigest()[:16]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeUnavailable("no C compiler (cc or gcc) on PATH")
    for d in ([out_dir] if out_dir else [cache_dir(), os.path.join(tempfile.gettempdir(), "megatron_lc")]):
        so = os.path.join(d, f"dsa_search-{tag}.so")
        if os.path.isfile(so):
            return so
        try:
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
        except OSError:
            continue  # not writable: the next directory
        r = subprocess.run([cc, "-O2", "-std=c99", "-shared", "-fPIC", "-I", here, src, "-o", tmp],
                           capture_output=True, text=True)
        if r.returncode:
            os.unlink(tmp)
            raise NativeUnavailable(f"{cc} failed on {src}: {r.stderr.strip()[:400]}")
        os.replace(tmp, so)
        return so
    raise NativeUnavailable(f"no writable cache directory for the build ({cache_dir()})")


def _bind(so: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(so)
    P, L = ctypes.POINTER(ctypes.c_longlong), ctypes.c_longlong
    lib.dsa_fit.restype = ctypes.c_int
    lib.dsa_fit.argtypes = ([ctypes.c_int] * 2 + [P] * 23 + [ctypes.c_int, P, ctypes.c_int, P, L, ctypes.c_double]
                            + [P, P])
    return lib


def load() -> Optional[ctypes.CDLL]:
    """The C core, built once per process on first use; None when it cannot be used (``why_not()`` says why)."""
    if os.environ.get(ENV, "1") == "0":
        lib, why = None, f"{ENV}=0"
    else:
        if "lib" not in _state:
            try:
                _state["lib"], _state["why"] = _bind(build()), ""
            except (NativeUnavailable, OSError) as e:
                _state["lib"], _state["why"] = None, str(e)
        lib, why = _state["lib"], _state["why"]
    if not _state.get("logged"):
        _state["logged"] = True
        log.info("exact DSA search: %s", "native C core" if lib is not None else f"pure Python ({why})")
    return lib


def why_not() -> str:
    """Why ``load()`` returns None ('' when it does not)."""
    return f"{ENV}=0" if os.environ.get(ENV, "1") == "0" else (load() is None and _state["why"]) or ""


def fit_native(lib: ctypes.CDLL, p: Prepared, capacity: int, runs: tuple, time_limit: float
               ) -> tuple[int, np.ndarray, int]:
    """One ``search.fit`` on the C core with ``runs``, pairs (preorder: letters of ``Prepared.rank``, backjumps):
    (OK | FAIL | ABORT, item bases (valid on OK), placements tried)."""
    def arr(a):
        a = np.ascontiguousarray(a, dtype=np.int64)
        keep.append(a)
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_longlong))

    keep: list = []  # the converted arrays live until the call returns
    span = np.array(p.span, dtype=np.int64).reshape(-1, 2)
    parts = np.array([(lo, hi) for _, lo, hi in p.partitions], dtype=np.int64).reshape(-1, 2)
    heur = np.full((len(runs), 5), -1, dtype=np.int64)  # letter codes as csrc's enum Key, -1 after the last; mode
    for h, (letters, backjumps) in enumerate(runs):
        heur[h, :len(letters)] = ["WATZV".index(c) for c in letters]
        heur[h, 4] = int(backjumps)
    sol = np.zeros(p.n, dtype=np.int64)
    nodes = ctypes.c_longlong(0)
    code = lib.dsa_fit(p.n, p.S, arr(p.height), arr(p.reach), arr(p.first), arr(span[:, 0]), arr(span[:, 1]),
                       arr(p.run_ptr), arr(p.run_lo), arr(p.run_hi), arr(p.run_h), arr(p.total), arr(p.cuts),
                       arr(p.adj_ptr), arr(p.adj_j), arr(p.adj_e), arr(p.members), arr(p.ptr), arr(p.byfirst),
                       arr(p.pf), arr(p.width), arr(p.area), arr(p.events), arr(p.canon), arr(p.adj_rev), len(parts),
                       arr(parts), len(runs), arr(heur), int(capacity), float(time_limit), arr(sol),
                       ctypes.byref(nodes))
    if code == NOMEM:
        raise MemoryError("the native DSA search ran out of memory")
    return code, sol, int(nodes.value)
