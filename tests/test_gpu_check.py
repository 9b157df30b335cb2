"""``launch/gpu_check.sh`` and ``launch/gpu_wheels.sh`` checked on a CPU machine: the caps fit 7 minutes,
every ``ernie5`` command the check runs parses and every test file it names exists, it refuses without a
GPU, and its verdict (``launch/gpu_summary.py``) counts what the steps left."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

CHECK = ROOT / "launch" / "gpu_check.sh"
SUMMARY = ROOT / "launch" / "gpu_summary.py"


def _dry_run() -> list[tuple[str, int, list[str]]]:
    r = subprocess.run(["bash", str(CHECK), "--dry-run"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    steps = []
    for line in lines[:-1]:
        name, _, cap, rest = line.split(None, 3)
        steps.append((name, int(cap.rstrip("s")), shlex.split(rest)))
    assert lines[-1] == f"total cap {sum(c for _, c, _ in steps)}s"
    return steps


def test_the_caps_sum_to_seven_minutes_or_less():
    steps = _dry_run()
    assert sum(cap for _, cap, _ in steps) <= 420
    names = [n for n, _, _ in steps]
    assert names[0] == "gpu" and names[1] == "install" and names[-1] == "summary"
    for want in ("bench_gemm", "bench_train", "bench_decode", "bench_parity"):
        assert want in names


def test_every_ernie5_command_parses_and_every_test_file_exists():
    from jobs.cli import build_parser

    parser = build_parser()
    seen = 0
    for name, _, argv in _dry_run():
        if argv[1:3] == ["-m", "jobs.cli"]:
            args = parser.parse_args(argv[3:])  # SystemExit (a failing test) on a bad option
            assert args.device == "cuda", name
            seen += 1
        elif argv[1:3] == ["-m", "pytest"]:
            files = [a for a in argv[3:] if a.endswith(".py")]
            assert files and all((ROOT / f).is_file() for f in files), name
    assert seen == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_refuses_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(CHECK), str(out)],
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"gpu_check: no CUDA GPU is visible to {sys.executable} (torch.cuda.is_available() is False); "
        "run it on a GPU machine"
    ]
    assert not out.exists()


def test_the_wheel_script_fetches_cpython_3_12_manylinux_wheels():
    r = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu_wheels.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout)
    assert argv[:4] == ["python3", "-m", "pip", "download"]
    assert "--python-version" in argv and argv[argv.index("--python-version") + 1] == "3.12"
    assert "--only-binary=:all:" in argv and "--no-deps" in argv and "manylinux_2_28_x86_64" in argv
    assert {a.split("==")[0] for a in argv if "==" in a} == {"jiwer", "rapidfuzz", "torchao"}


def _summary(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUMMARY), *args], capture_output=True, text=True, timeout=60)


def _junit(path: Path, cases: dict[str, str]) -> None:
    body = []
    for name, outcome in cases.items():
        inner = {
            "passed": "",
            "failed": '<failure message="boom"/>',
            "skipped": '<skipped message="no fp8"/>',
        }
        body.append(f'<testcase classname="tests.x" name="{name}">{inner[outcome]}</testcase>')
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(body)}</testsuite></testsuites>')


def _night(out: Path, *, failed_test: bool = False, killed: bool = False, no_wheels: bool = False) -> None:
    out.mkdir()
    steps = [("install", 0), ("tests_model", 1 if failed_test else 0), ("tests_train", 124 if killed else 0)]
    steps += [("bench_gemm", 0), ("bench_train", 0), ("bench_decode", 0), ("bench_parity", 0)]
    (out / "steps.tsv").write_text("".join(f"{n}\t{rc}\t10\t100.0\t101.5\n" for n, rc in steps))
    (out / "install.out").write_text("no wheels in .whl (...)\n" if no_wheels else "")
    _junit(out / "junit_tests_model.xml", {"a": "failed" if failed_test else "passed", "b": "passed"})
    if not killed:
        _junit(out / "junit_tests_train.xml", {"c": "passed", "d": "skipped"})
    (out / "bench_gemm.out").write_text(json.dumps({"grouped_over_dense": 0.72}))
    (out / "bench_train.out").write_text(json.dumps({"mfu": 0.31}))
    rows = [{"spec": "full", "dtype": "fp32", "fraction_of_bandwidth_bound": 0.2}]
    rows.append({"spec": "full", "dtype": "bf16", "fraction_of_bandwidth_bound": 0.55})
    (out / "bench_decode.out").write_text(json.dumps({"subnets": rows}))
    (out / "bench_parity.out").write_text(json.dumps({"forward_rel_l2": 3e-6}))


def test_a_clean_run_passes_and_reports_each_goal(tmp_path):
    out = tmp_path / "night"
    _night(out)
    r = _summary("verdict", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1] == "GPU CHECK PASS: 8 passed, 0 failed, 1 skipped"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "GPU CHECK PASS: 8 passed, 0 failed, 1 skipped"
    goals = summary["goals"]
    assert goals["grouped_gemm_over_dense_bf16"] == {"value": 0.72, "goal": ">= 0.6", "met": True}
    assert goals["training_mfu"]["met"] is False and goals["decode_over_hbm_bound"]["value"] == 0.55
    assert goals["forward_parity_rel_l2_fp32"] == {"value": 3e-6, "goal": "<= 0.0001", "met": True}
    assert summary["cap_s"] == 70 and summary["wall_s"] == pytest.approx(10.5)
    assert "goal training_mfu >= 0.4: 0.31 (not met)" in r.stdout


@pytest.mark.parametrize(
    ("kind", "line"),
    [
        ({"failed_test": True}, "GPU CHECK FAIL: 7 passed, 1 failed, 1 skipped"),
        ({"killed": True}, "GPU CHECK FAIL: 7 passed, 1 failed, 0 skipped"),
        ({"no_wheels": True}, "GPU CHECK PASS: 7 passed, 0 failed, 2 skipped"),
    ],
)
def test_a_failure_or_a_step_killed_at_its_cap_fails_the_check(tmp_path, kind, line):
    out = tmp_path / "night"
    _night(out, **kind)
    r = _summary("verdict", str(out))
    assert r.stdout.strip().splitlines()[-1] == line
    assert r.returncode == (0 if line.startswith("GPU CHECK PASS") else 1)


def test_everything_skipped_is_a_failure(tmp_path):
    out = tmp_path / "night"
    out.mkdir()
    (out / "steps.tsv").write_text("install\t0\t30\t1.0\t2.0\ntests_model\t0\t90\t2.0\t3.0\n")
    (out / "install.out").write_text("no wheels in .whl\n")
    _junit(out / "junit_tests_model.xml", {"a": "skipped"})
    r = _summary("verdict", str(out))
    assert (
        r.returncode == 1
        and r.stdout.strip().splitlines()[-1] == "GPU CHECK FAIL: 0 passed, 0 failed, 2 skipped"
    )


def test_install_puts_the_wheels_on_a_private_target(tmp_path):
    wheels = tmp_path / "whl"
    r = _summary("install", "--wheels", str(wheels), "--target", str(tmp_path / "site"))
    assert r.returncode == 0 and r.stdout.startswith("no wheels in ")
    wheels.mkdir()
    info = "tinypkg-1.0.dist-info"
    with zipfile.ZipFile(wheels / "tinypkg-1.0-py3-none-any.whl", "w") as z:
        z.writestr("tinypkg/__init__.py", "VALUE = 42\n")
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n")
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    r = _summary("install", "--wheels", str(wheels), "--target", str(tmp_path / "site"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "site" / "tinypkg" / "__init__.py").read_text() == "VALUE = 42\n"
