"""Honest dependencies: pyproject.toml declares the third-party packages the project's code imports,
and nothing it does not use."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from functools import cache
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ernie5", "train", "evals", "reports", "jobs", "suites")
USED_WITHOUT_IMPORT = {"pyarrow": ("evals/results.py", ".to_parquet(")}
"""Declared packages the code uses through another one: name -> (file, the call that needs it)."""
TOOLS = {"pytest", "ruff", "hypothesis"}  # the test runner, the linter, the fuzzer (tests/test_fuzz.py)
"""Packages of the ``test`` extra that run the tests rather than being imported."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(req: str) -> str:
    return _norm(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0])


def _imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Third-party top-level modules -> files, for module-level imports (needed to import the
    module at all) and for the rest (inside functions or ``try``: optional features)."""
    first_party, stdlib = set(PACKAGES), set(sys.stdlib_module_names)
    top: dict[str, set[str]] = {}
    nested: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            module_level = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root in first_party or root in stdlib:
                        continue
                    where = top if id(node) in module_level else nested
                    where.setdefault(root, set()).add(str(path.relative_to(ROOT)))
    return top, nested


@cache
def _module_distributions() -> dict[str, list[str]]:
    return packages_distributions()


GPU_ONLY = {"torchao"}
"""Optional GPU features whose packages a CPU machine does not install: imported only inside the
function that needs them, declared in an extra under the same name."""


@cache
def _distribution(module: str) -> str:
    dists = _module_distributions().get(module)
    if not dists and module in GPU_ONLY:
        return _norm(module)
    assert dists, f"import {module}: no installed distribution provides it"
    return _norm(dists[0])


def test_pyproject_declares_exactly_what_the_code_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_requirement_name(r) for r in project["dependencies"]}
    extras = {
        name: {_requirement_name(r) for r in reqs} for name, reqs in project["optional-dependencies"].items()
    }
    optional = set().union(*extras.values())
    top, nested = _imports()
    used = {_distribution(m): files for m, files in top.items()}
    for m, files in nested.items():
        used.setdefault(_distribution(m), set()).update(files)

    undeclared = {d: sorted(f) for d, f in used.items() if d not in core | optional}
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    needed_at_import = {_distribution(m): sorted(f) for m, f in top.items()}
    optional_only = {d: f for d, f in needed_at_import.items() if d not in core}
    assert not optional_only, f"imported at module level but only an optional extra: {optional_only}"

    for name, (file, call) in USED_WITHOUT_IMPORT.items():
        assert name in core and call in (ROOT / file).read_text(encoding="utf-8"), (name, file, call)
    unused = sorted(core - set(used) - set(USED_WITHOUT_IMPORT))
    assert not unused, f"declared in pyproject.toml but never imported by the code: {unused}"
    for name, reqs in extras.items():
        idle = sorted(reqs - set(used) - TOOLS)
        assert not idle, f"extra {name!r} declares packages the code never imports: {idle}"


def test_declared_ranges_hold_the_installed_versions():
    """Each declared range admits the installed version (the ranges are what was tested)."""
    from importlib.metadata import version

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    outside = [
        f"{r} (installed {version(r.name)})"
        for r in reqs
        if not r.specifier.contains(version(r.name).split("+")[0], prereleases=True)
    ]
    assert not outside, outside
