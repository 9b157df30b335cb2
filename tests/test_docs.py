"""README.md and ARCHITECTURE.md name only what exists: files and folders, Python names, ``ernie5``
commands with their flags, and suites.

A doc goes stale silently when code moves; these checks read every backticked span of the two
documents a newcomer reads first and resolve it against the repository:

  * a path (``train/pretrain/loop.py``, ``evals/tasks/``, ``model/config.py``, ``tests/**/test_cuda.py``,
    ``evals/tasks/<name>.py``) exists from the root, from ``ernie5/`` (ARCHITECTURE's table of the
    library's folders), or, for a bare file name, anywhere in the tree; a file a run writes
    (``report/index.html``, ``OUT/study.json``) is instead named by a string in the code;
  * a dotted name (``ernie5.subnets.spec.resolve_specs``, ``evals/metrics.choice_accuracy``) is a
    module that exists and defines the name;
  * ``ernie5 CMD --flag ...`` names a command of the CLI and flags that command takes;
  * the README's list of suites is the set of ``suites/*.yaml``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from jobs.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "ARCHITECTURE.md")
PACKAGES = ("ernie5", "train", "evals", "reports", "jobs", "tests", "suites", "launch")
EXTENSIONS = (".py", ".yaml", ".md", ".sh", ".json", ".jsonl", ".csv", ".html", ".cpp", ".toml", ".ini")
# Placeholders a doc uses for a folder of the user's choosing; what follows them is a run's file.
PLACEHOLDERS = ("OUT", "RUN_DIR", "DIR", "CKPT", "runs")
QUOTE = "[\"'/]"  # what stands either side of a file name written in the code


@cache
def tracked() -> tuple[str, ...]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return tuple(out.stdout.split())


@cache
def code_strings() -> str:
    """Every .py file's text, where a run-folder file name must appear."""
    own = Path(__file__).relative_to(ROOT).as_posix()
    files = [f for f in tracked() if f.endswith(".py") and f != own and (ROOT / f).is_file()]
    return "\n".join((ROOT / f).read_text() for f in files)


def spans(doc: str) -> list[tuple[int, str]]:
    """(line number, text) of every backticked span of ``doc``, fenced blocks excluded."""
    out, fenced = [], False
    for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m) for m in re.findall(r"`([^`]+)`", line)]
    return out


def fenced_lines(doc: str) -> list[tuple[int, str]]:
    out, fenced = [], False
    for i, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            out.append((i, line))
    return out


def _glob_exists(base: Path, pattern: str) -> bool:
    """Whether a file or folder of the repository (tracked or not ignored: never a stale
    ``__pycache__``) matches ``pattern`` under ``base``."""
    prefix = base.relative_to(ROOT).as_posix()
    prefix = "" if prefix == "." else prefix + "/"
    pattern = prefix + re.sub(r"<[^>]+>", "*", pattern.rstrip("/"))
    files = tracked()
    if "*" not in pattern:
        return pattern in files or any(f.startswith(pattern + "/") for f in files)
    regex = re.compile(re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*") + "(?:/.*)?")
    return any(regex.fullmatch(f) for f in files)


def path_exists(word: str) -> bool:
    head = word.split("/", 1)[0]
    if head in PLACEHOLDERS or word.startswith("../"):
        name = word.rstrip("/").rsplit("/", 1)[-1]
        return name in PLACEHOLDERS or bool(re.search(rf"[\"'/]{re.escape(name)}[\"']", code_strings()))
    if _glob_exists(ROOT, word) or _glob_exists(ROOT / "ernie5", word):
        return True
    if "/" not in word.rstrip("/"):  # a bare name: anywhere in the tree, or a file a run writes
        name = word.rstrip("/")
        if any(f.rsplit("/", 1)[-1] == name or f"/{name}/" in f"/{f}" for f in tracked()):
            return True
        return bool(re.search(rf"[\"'/]{re.escape(name)}[\"']", code_strings()))
    if head in PACKAGES or head == "ernie5":
        return False  # a path into the repository's own folders must exist
    # a run folder's file (report/index.html, routing/*.json): its parts are named in the code
    parts = [p for p in re.sub(r"<[^>]+>|\*+", "", word).split("/") if p and p not in ("*", "**")]

    def named(p: str) -> bool:  # ".jsonl" of f"{task}.jsonl" is a suffix; anything else a whole name
        before = "" if p.startswith(".") else QUOTE
        return bool(re.search(before + re.escape(p) + QUOTE, code_strings()))

    return all(named(p) for p in parts)


def _defines(file: Path, name: str) -> bool:
    text = file.read_text()
    return bool(re.search(rf"^(?:def|class|async def) {name}\b|^{name}\b\s*[:=]", text, re.M)) or bool(
        re.search(rf"^\s+(?:def|class) {name}\b", text, re.M)
    )


def _config_key(parts: list[str]) -> bool:
    """``train.fp8``: a YAML section and a field of a config dataclass of that package."""
    if len(parts) != 2 or not (ROOT / parts[0]).is_dir():
        return False
    field = re.compile(rf"^    {re.escape(parts[1])}: [^=]+=", re.M)
    return any(
        field.search((ROOT / f).read_text())
        for f in tracked()
        if f.startswith(f"{parts[0]}/") and f.endswith(".py")
    )


def dotted_exists(word: str) -> bool:
    """``a.b.c.name`` or ``a/b.name``: the longest module prefix exists and defines the rest; or
    a config key (``train.init_from``)."""
    parts = word.replace("/", ".").split(".")
    if "/" not in word and _config_key(parts):
        return True
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        rest = parts[cut:]
        for file in (base.with_suffix(".py"), base / "__init__.py"):
            if file.is_file():
                if not rest:
                    return True
                if len(rest) == 1 and _defines(file, rest[0]):
                    return True
                return len(rest) == 2 and _defines(file, rest[0]) and _defines(file, rest[1])  # Class.method
    return False


def references(doc: str) -> list[tuple[int, str, str]]:
    """(line, kind, word) for every path or dotted name in ``doc``'s backticked spans."""
    out = []
    for line, span in spans(doc):
        for word in span.split():
            word = word.strip("()[],;:'\"")
            if not word or word.startswith(("-", "http", "$")) or "=" in word:
                continue
            if re.fullmatch(rf"(?:{'|'.join(PACKAGES)})(?:\.\w+)+", word) and not word.endswith(EXTENSIONS):
                out.append((line, "dotted", word))
            elif re.fullmatch(r"[\w.*<>/-]+/[A-Za-z_]\w*\.[A-Za-z_]\w*", word) and not word.endswith(
                EXTENSIONS
            ):
                out.append((line, "dotted", word))  # evals/metrics.choice_accuracy
            elif (
                ("/" in word or word.endswith(EXTENSIONS))
                and re.fullmatch(r"[\w.*<>/-]+", word)
                and not re.fullmatch(r"[\W\d]+", word)
            ):
                out.append((line, "path", word))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_existing_files_and_names(doc: str) -> None:
    missing = [
        f"{doc}:{line}: `{word}`"
        for line, kind, word in references(doc)
        if not (path_exists(word) if kind == "path" else dotted_exists(word))
    ]
    assert not missing, "names that do not exist:\n" + "\n".join(missing)


# Commands that hand their arguments to another tool (lm-eval's own command line).
PASS_THROUGH = ("lm-eval",)
# Flags of other tools the README's prose names (accelerate's multi-node launch).
FOREIGN_FLAGS = ("--machine_rank",)


def _commands() -> dict[str, set[str]]:
    """Each ``ernie5`` command (``bench``, ``study`` ...) and the option strings it takes."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    out = {}
    for name, p in sub.choices.items():
        flags = {s for a in p._actions for s in a.option_strings}
        for a in p._actions:  # nested commands (study elastic ...) add their flags to the command's
            if isinstance(a, argparse._SubParsersAction):
                flags |= {s for q in a.choices.values() for b in q._actions for s in b.option_strings}
        out[name] = flags
    return out


def command_uses(doc: str) -> list[tuple[int, str, list[str]]]:
    """(line, command, flags) of every ``ernie5 CMD ...`` in ``doc``: fenced lines and their
    indented continuation lines (comments excluded), and backticked spans."""
    out, current = [], None
    for line, text in fenced_lines(doc):
        m = re.match(r"\s*ernie5 (\w[\w-]*)", text)
        if m:
            current = m.group(1)
        elif not text.startswith(" ") or text.strip().startswith("#"):
            current = None if not text.startswith(" ") else current
            continue
        if current:
            code = text.split("#", 1)[0]
            out.append((line, current, re.findall(r"(?<![\w-])--[a-z][\w-]*", code)))
    for line, span in spans(doc):
        for m in re.finditer(r"\bernie5 (\w[\w-]*)([^`]*)", span):
            out.append((line, m.group(1), re.findall(r"(?<![\w-])--[a-z][\w-]*", m.group(2))))
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_docs_name_existing_commands_and_flags(doc: str) -> None:
    commands = _commands()
    bad = []
    for line, cmd, flags in command_uses(doc):
        if cmd not in commands:
            bad.append(f"{doc}:{line}: `ernie5 {cmd}` is not a command ({', '.join(sorted(commands))})")
            continue
        if cmd in PASS_THROUGH:
            continue
        bad += [f"{doc}:{line}: `ernie5 {cmd}` takes no {f}" for f in flags if f not in commands[cmd]]
    assert not bad, "\n".join(bad)


def test_readme_flags_in_prose_exist() -> None:
    """A ``--flag`` written in the README's prose is a flag of some ``ernie5`` command."""
    every = set().union(*_commands().values())
    foreign = ("pip", "pytest", "accelerate", "torchrun", "chromium", "lm_eval", "bash", "python")
    bad = [
        f"README.md:{line}: {flag}"
        for line, span in spans("README.md")
        if not span.startswith(foreign)
        for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", span)
        if flag not in every and flag not in FOREIGN_FLAGS
    ]
    assert not bad, "flags no command takes:\n" + "\n".join(bad)


def test_readme_lists_every_suite() -> None:
    (row,) = [t for t in (ROOT / "README.md").read_text().splitlines() if t.startswith("| `suites/`")]
    named = set(re.findall(r"`(\w+)`", row))
    shipped = {p.stem for p in (ROOT / "suites").glob("*.yaml")}
    assert shipped <= named, f"README's suites row misses {sorted(shipped - named)}"
    assert not (named - shipped - {"suites"}) - {"ernie5"}, f"not suites: {sorted(named - shipped)}"


def test_the_checks_catch_what_they_are_for() -> None:
    """The resolvers reject the stale names this test exists for."""
    assert not path_exists("perf-anchors.md")
    assert not path_exists("train/no_such_module.py") and not path_exists("train/parallel/")
    assert path_exists("evals/tasks/<name>.py") and path_exists("tests/**/test_cuda.py")
    assert path_exists("OUT/study.json") and not path_exists("OUT/no_such_output.json")
    assert dotted_exists("ernie5.subnets.spec.resolve_specs")
    assert not dotted_exists("ernie5.subnets.resolve.resolve_specs")
    assert not dotted_exists("ernie5.subnets.spec.no_such_name")
    assert dotted_exists("train.init_from") and not dotted_exists("train.no_such_key")
