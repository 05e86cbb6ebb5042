"""The package's import graph: no cycles, and no imports hidden inside functions.

The graph is read from the source (``ast``), not from ``sys.modules``, so a cycle is found even when the import
order of the day happens to work. A module imports a module M and, implicitly, every package above M that is not
also above the importer (Python runs those ``__init__`` files first). A function-local import is allowed only for
an optional or heavy third-party dependency, with its reason in a comment on the line or over its group; a
function-local import of ``megatron_lc`` is always a hidden edge of this graph, and refused."""
from __future__ import annotations

import ast
import os

import pytest

PKG = "megatron_lc"
ROOT = os.path.join(os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")), PKG)


def _modules(root: str = ROOT) -> dict:
    """{dotted module name: path}; a package is its ``__init__``."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(root))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _imports(name: str, path: str, modules: dict):
    """(target module, line, at module level?) of every import of a ``megatron_lc`` module in ``path``, and the
    function-local imports of other modules as (module, line)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    local_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    internal, external = [], []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([mod] if mod else []))
            # ``from pkg import name``: name may be a submodule of pkg
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        top = id(node) not in local_nodes
        for t in targets:
            if t.split(".")[0] == PKG:
                internal.append((t, node.lineno, top))
            elif not top:
                external.append((t, node.lineno))
    return internal, external


def import_graph(root: str = ROOT) -> dict:
    """{module: set of modules it imports, parent packages included (see module doc)}. Imports inside functions
    count too: they are the same dependency, run later."""
    modules = _modules(root)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, _, _ in _imports(name, path, modules)[0]:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                t = ".".join(parts[:i])
                if t in modules and not (name == t or name.startswith(t + ".")):
                    edges.add(t)
        graph[name] = edges
    return graph


def cycles(graph: dict) -> list:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_detector_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_hidden_imports():
    """No function-local import of the package; a function-local third-party import says why in a comment."""
    modules = _modules()
    bad = []
    for name, path in sorted(modules.items()):
        internal, external = _imports(name, path, modules)
        lines = open(path).read().splitlines()
        bad += [f"{path}:{line}: imports {t} inside a function" for t, line, top in internal if not top]
        for t, line in external:
            near = lines[max(0, line - 5):line]  # the line, or a comment over its group of imports
            if not any("#" in ln for ln in near):
                bad.append(f"{path}:{line}: imports {t} inside a function without a comment saying why")
    assert not bad, "\n".join(bad)


def package_graph(graph: dict) -> dict:
    """The module graph folded into top-level packages (a top-level module is a package of its own)."""
    def pkg(m):
        return (m.split(".") + ["(top)"])[1]
    out: dict = {}
    for a, bs in graph.items():
        out.setdefault(pkg(a), set()).update(pkg(b) for b in bs if pkg(b) != pkg(a))
    return out


# Every folder is one layer: a package imports only packages of lower layers. compose/ is the composition root,
# the one package that knows every technique; training/ runs what it builds; estimate/ and hf.py read both.
LAYERS = [
    {"(top)", "config", "units"},
    {"device"},  # the device adapter, the host pool and its budget
    {"parallel", "data"},
    {"model"},
    {"attention", "memory"},  # independent of each other: memory calls the core-attention protocol of the model
    {"planning"},
    {"compose"},
    {"training"},
    {"estimate", "hf"},
    {"rehearsal"},  # runs the training setup and step under fake tensors, beside the estimator
]


# Inside a folder its subfolders are layers too, below or above the folder's own files ("*": every other module of
# the folder). training/: the errors that end a run and a step's micro-batches <- checkpointing/ | eval/ <- the rest.
# planning/: the trace format <- capture/ | solver/ <- the planner, the plan and the runtime that applies it.
# estimate/: the sizes and the hardware <- the inventory, the ring's balance <- the kernels' formulas <- the layers' <- terms/ (one per
# technique) <- the estimates, the search.
SUBLAYERS = {
    "training": [{"errors", "batches"}, {"checkpointing", "eval"}, {"*"}],
    "planning": [{"trace"}, {"capture", "solver"}, {"*"}],
    "estimate": [{"dims", "hardware"}, {"moe"}, {"inventory", "ring_balance"}, {"flops", "states", "attention_kernels"},
                 {"transient"},
                 {"terms"}, {"*"}],
}


def layering_violations(packages: dict, layers: list = LAYERS) -> list:
    """Each ``a -> b`` edge whose ``b`` is not in a lower layer than ``a`` (an unknown package is a violation;
    ``"*"`` in ``layers`` stands for every name not listed, and those may import each other)."""
    layer = {p: i for i, ps in enumerate(layers) for p in ps}
    rest = layer.get("*")
    layer = {p: i for p, i in layer.items() if p != "*"}
    bad = []
    for a, bs in sorted(packages.items()):
        for b in sorted(bs):
            la, lb = layer.get(a, rest), layer.get(b, rest)
            if a not in layer and b not in layer and rest is not None:
                continue  # two of the folder's other modules: one layer, ordered by the no-cycle test
            if la is None or lb is None or lb >= la:
                bad.append(f"{a} (layer {la}) imports {b} (layer {lb})")
    return bad


def test_layering_detector_sees_an_edge_up():
    assert layering_violations({"parallel": {"config"}, "config": set()}) == []
    assert layering_violations({"parallel": {"compose"}}) == ["parallel (layer 2) imports compose (layer 6)"]
    assert layering_violations({"memory": {"attention"}}) == ["memory (layer 4) imports attention (layer 4)"]


def test_packages_are_layered():
    """Folder by folder (``LAYERS``): config <- device <- parallel | data <- model <- attention | memory <- planning
    <- compose <- training <- estimate | hf <- rehearsal; no package imports one of its own layer or above."""
    packages = package_graph(import_graph())
    bad = layering_violations(packages)
    assert not bad, "\n".join(bad)


def folder_graph(graph: dict, folder: str) -> dict:
    """The module graph of ``megatron_lc.<folder>`` folded into its children (a subfolder or a module each);
    ``__init__`` files are left out (they import nothing of their folder)."""
    prefix = f"{PKG}.{folder}."

    def child(m):
        return m[len(prefix):].split(".")[0] if m.startswith(prefix) else None
    out: dict = {}
    for a, bs in graph.items():
        ca = child(a)
        if ca is None:
            continue
        out.setdefault(ca, set()).update(c for c in map(child, bs) if c is not None and c != ca)
    return out


def test_sublayer_detector_sees_an_edge_up():
    graph = {f"{PKG}.training.checkpointing.save": {f"{PKG}.training.loop"}, f"{PKG}.training.loop": set()}
    assert layering_violations(folder_graph(graph, "training"), SUBLAYERS["training"]) == [
        "checkpointing (layer 1) imports loop (layer 2)"]


@pytest.mark.parametrize("folder", sorted(SUBLAYERS))
def test_subfolders_are_layered(folder):
    """``SUBLAYERS``: inside a folder, a subfolder imports only the modules of the layers below it."""
    bad = layering_violations(folder_graph(import_graph(), folder), SUBLAYERS[folder])
    assert not bad, "\n".join(bad)
