"""The house rules of ARCHITECTURE.md, checked on the source: layers import only downward, no
module imports another in a circle, and ``ernie5/model/`` is the paper's maths and nothing else.

Imports are read with ``ast`` from every module, those inside functions included (a lazy import
is still an import), so the rules hold for whatever a process ends up loading.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ernie5", "train", "evals", "reports", "jobs", "suites")
ALLOWED = {
    "ernie5": {"ernie5"},
    "train": {"ernie5", "train"},
    "evals": {"ernie5", "evals"},
    "reports": {"ernie5", "evals", "reports"},  # the run-folder contract (evals.results, evals.metrics)
    "jobs": {"ernie5", "train", "evals", "reports", "jobs", "suites"},
    "suites": set(),
}
"""Top-level package -> the project packages its modules may import (layers import downward only;
``train`` and ``evals`` never import each other)."""
MODEL_MAY_IMPORT = ("ernie5.model", "ernie5.config")
MODEL_MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


MODULES = _modules()


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules (keys of ``modules``) that ``name`` imports (``from pkg import sub``
    counts as ``pkg.sub`` when ``sub`` is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # ``import a.b.c`` of a module ``a.b``: the longest module prefix
                t = t.rpartition(".")[0]
            if t and t.split(".")[0] in PACKAGES:
                found.add(t)
    found.discard(name)
    return found


GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def test_the_tree_is_read() -> None:
    expected = {"ernie5.model.model", "ernie5.fast.apply", "jobs.cli", "evals.sweep", "train.pretrain.loop"}
    assert expected <= MODULES.keys()
    assert {"ernie5.fast", "ernie5.model.model"} <= GRAPH["ernie5.store.checkpoint"]  # real edges are seen
    assert "ernie5.sequence.audio" in GRAPH["evals.adapter"]  # ``from pkg import module as name``


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers_import_only_downward(name: str) -> None:
    top = name.split(".")[0]
    bad = sorted(m for m in GRAPH[name] if m.split(".")[0] not in ALLOWED[top])
    assert not bad, f"{name} imports {bad}: {top} may import only {sorted(ALLOWED[top])}"


def test_the_model_is_the_maths_only() -> None:
    for name in (n for n in MODULES if n.startswith("ernie5.model")):
        bad = sorted(m for m in GRAPH[name] if not m.startswith(MODEL_MAY_IMPORT))
        assert not bad, f"{name} imports {bad}; ernie5/model/ may import only {MODEL_MAY_IMPORT}"
        lines = len(MODULES[name].read_text(encoding="utf-8").splitlines())
        assert lines <= MODEL_MAX_LINES, f"{MODULES[name]} has {lines} lines (at most {MODEL_MAX_LINES})"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


def test_a_cycle_and_an_upward_import_would_be_caught(tmp_path: Path) -> None:
    """The reading these checks rely on finds a planted lazy cycle and an upward import."""
    pkg = tmp_path / "ernie5"
    pkg.mkdir()
    (pkg / "a.py").write_text("from ernie5 import b\nimport evals.sweep\n")
    (pkg / "b.py").write_text("def f():\n    from ernie5.a import g\n")
    modules = {"ernie5.a": pkg / "a.py", "ernie5.b": pkg / "b.py", "evals.sweep": pkg / "a.py"}
    assert _imports("ernie5.a", pkg / "a.py", modules) == {"ernie5.b", "evals.sweep"}
    assert _imports("ernie5.b", pkg / "b.py", modules) == {"ernie5.a"}
    graph = {n: _imports(n, p, modules) for n, p in modules.items() if n != "evals.sweep"}
    assert _cycles(graph) == [["ernie5.a", "ernie5.b"]]
    assert "evals" not in ALLOWED["ernie5"]


CODE_MAX_LINES = 500


def test_a_long_module_says_why_in_one_line() -> None:
    """Every code module over 500 lines gives its reason in its docstring ("Over 500 lines ...")."""
    unexplained = []
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") + 1 > CODE_MAX_LINES:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "Over 500 lines" not in doc:
                unexplained.append(name)
    assert not unexplained, f"over {CODE_MAX_LINES} lines with no reason in the docstring: {unexplained}"
