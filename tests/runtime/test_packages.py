"""Optional packages a GPU image may lack (lm-eval, jiwer, datasets, evaluate, torchao): every module
still imports, and what needs one is a recorded skip or a one-line error naming it. Run in a
subprocess with the packages hidden (``sys.modules[name] = None``, which is how Python reports a
package that is not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ernie5.runtime.packages import OPTIONAL, have, missing_reason
from tests.conftest import ROOT, cli_env

HIDE = "import sys\nfor _m in {names!r}:\n    sys.modules[_m] = None\n"


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    prologue = HIDE.format(names=sorted(OPTIONAL))
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(code), *args],
        env=cli_env(**env),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_have_and_the_reason_name_the_package(monkeypatch):
    assert have("json") and missing_reason("json", "os") == ""
    monkeypatch.setitem(sys.modules, "jiwer", None)
    assert not have("jiwer")
    assert missing_reason("json", "jiwer") == "needs the Python package jiwer (pip install 'jiwer>=3.0')"
    assert (
        missing_reason("no_such_module_x")
        == "needs the Python package no_such_module_x (pip install 'no_such_module_x')"
    )


def test_every_module_imports_without_the_optional_packages():
    r = _run(
        """
        import importlib, pkgutil
        bad = []
        for pkg in ("ernie5", "train", "evals", "reports", "jobs"):
            for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
                if info.name.startswith("evals.lm_eval.") and info.name.rsplit(".", 1)[1] in ("cli", "model"):
                    continue  # lm-eval's own classes, imported only where lm-eval runs
                try:
                    importlib.import_module(info.name)
                except Exception as e:
                    bad.append(f"{info.name}: {e!r}")
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
        """
    )
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_sweep_without_them_skips_what_needs_them_naming_the_package(tmp_path):
    from evals.lm_eval.unit import shipped_task_dir

    suite = tmp_path / "suite.yaml"
    suite.write_text(
        textwrap.dedent(
            f"""
            name: bare_image
            batch_size: 16
            tasks:
              - {{task: arith_d1, limit: 4}}
              - {{task: asr_dtmf, limit: 2}}
              - {{task: tts_dtmf, limit: 2}}
            subnets: {{specs: [full]}}
            efficiency: {{enabled: false}}
            lm_eval:
              - {{task_dir: {shipped_task_dir()}, tasks: [arc_easy_local], limit: 2}}
            """
        )
    )
    out = tmp_path / "run"
    r = _run(
        """
        from jobs.cli import main
        sys.exit(main(sys.argv[1:]))
        """,
        "sweep",
        "--checkpoint",
        "reference",
        "--suite",
        str(suite),
        "--out",
        str(out),
        "--quiet",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    units = {}
    for path in (out / "units").rglob("*.json"):
        rec = json.loads(path.read_text())
        units[rec["task"]] = (rec["status"], rec.get("reason", ""))
    assert units["arith_d1"] == ("ok", "")
    for task in ("asr_dtmf", "tts_dtmf"):
        assert units[task] == ("skipped", "needs the Python package jiwer (pip install 'jiwer>=3.0')")
    status, reason = units["lmeval-arc_easy_local"]
    assert status == "skipped" and "needs the Python package lm-eval" in reason
    assert "needs the Python package jiwer" in r.stderr  # the sweep's list of skipped tasks


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["lm-eval", "--model", "ernie5", "--tasks", "x"],
            "`ernie5 lm-eval` needs the Python package lm-eval",
        ),
        (
            [
                "train",
                "--config",
                "micro",
                "--out",
                "{tmp}/fp8",
                "--set",
                "train.fp8_emulate=true",
                "--set",
                "train.fp8=true",
            ],
            "needs the torchao package",
        ),
    ],
)
def test_commands_that_need_a_missing_package_stop_with_one_line(argv, line, tmp_path):
    r = _run(
        """
        from jobs.cli import main
        sys.exit(main(sys.argv[1:]))
        """,
        *[a.replace("{tmp}", str(tmp_path)) for a in argv],
    )
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and line in err[0], r.stderr
