"""The two helpers of ``launch/gpu_check.sh`` (standard library only: it runs before any wheel is in).

``install --wheels DIR --target SITE``: pip-install every wheel of ``DIR`` into ``SITE`` (no index, no
dependencies, no byte-compiling: the check's own ``PYTHONPATH`` then finds them). No wheels there:
one line saying what skips, exit 0.

``verdict OUT_DIR``: read what the steps left in ``OUT_DIR`` (``steps.tsv``: name, exit status, cap,
start and end time; ``junit_<step>.xml`` of the test steps; ``<step>.out``: the benchmarks' JSON) and
write ``OUT_DIR/summary.json``: every test's outcome, every step's time, the benchmarks' figures and
each goal of issue 42 beside its measured value. Counting: each test is one check; each other step
(the install, every benchmark) is one more, passed when it exited 0 (and printed JSON), skipped when
the install had no wheels; a test step that left no JUnit file (killed at its cap, or it crashed
before pytest wrote one) counts as one failure. Prints each goal, then the verdict as its last line,
``GPU CHECK PASS|FAIL: n passed, m failed, k skipped``; exits 0 only on PASS (nothing failed and
something passed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GOALS = {
    # name: (benchmark step, how to read the figure from its JSON, goal, higher is better)
    "grouped_gemm_over_dense_bf16": ("bench_gemm", lambda d: d["grouped_over_dense"], 0.6, True),
    "training_mfu": ("bench_train", lambda d: d["mfu"], 0.40, True),
    "decode_over_hbm_bound": (
        "bench_decode",
        lambda d: next(r for r in d["subnets"] if r["spec"] == "full" and r["dtype"] == "bf16")[
            "fraction_of_bandwidth_bound"
        ],
        0.5,
        True,
    ),
    "forward_parity_rel_l2_fp32": ("bench_parity", lambda d: d["forward_rel_l2"], 1e-4, False),
}
NO_WHEELS = "no wheels"


def install(wheels: Path, target: Path) -> int:
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        print(f"{NO_WHEELS} in {wheels} (launch/gpu_wheels.sh fetches them): the checks that need them skip")
        return 0
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--no-cache-dir", "--upgrade", "--target", str(target), *map(str, found)]
    return subprocess.run(cmd).returncode


def _steps(out: Path) -> list[dict]:
    rows = []
    path = out / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        name, rc, cap, t0, t1 = line.split("\t")
        rows.append(
            {"name": name, "rc": int(rc), "cap_s": int(cap), "seconds": round(float(t1) - float(t0), 2)}
        )
    return rows


def _junit(path: Path) -> list[dict]:
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "")[:300]
        tests.append(
            {"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "message": message}
        )
    return tests


def _text(path: Path) -> str:
    return path.read_text() if path.is_file() else ""


def _test_checks(out: Path, name: str, rc: int) -> list[dict]:
    """Every test of a pytest step, plus one failure when the step left no complete JUnit report."""
    junit = out / f"junit_{name}.xml"
    checks = _junit(junit) if junit.is_file() else []
    if not junit.is_file() or rc in (124, 137):
        why = "killed at its cap" if rc in (124, 137) else f"exit {rc}"
        checks.append({"id": name, "outcome": "failed", "message": f"{why}, no complete JUnit report"})
    return checks


def _bench_check(out: Path, name: str, rc: int) -> tuple[dict, dict | None]:
    """A benchmark step: passed when it exited 0 and printed JSON (its figures), else failed."""
    try:
        figures = json.loads(_text(out / f"{name}.out")) if rc == 0 else None
    except json.JSONDecodeError:
        figures = None
    if figures is not None:
        return {"id": name, "outcome": "passed", "message": ""}, figures
    last = _text(out / f"{name}.err").strip().splitlines()[-1:]
    return {"id": name, "outcome": "failed", "message": f"exit {rc}: {''.join(last)}"[:300]}, None


def verdict(out: Path) -> int:
    steps = _steps(out)
    checks: list[dict] = []
    figures: dict[str, dict] = {}
    for step in steps:
        name, rc = step["name"], step["rc"]
        if name.startswith("tests_"):
            checks += _test_checks(out, name, rc)
        elif name == "install":
            text = _text(out / f"{name}.out")
            outcome = "failed" if rc else ("skipped" if text.startswith(NO_WHEELS) else "passed")
            checks.append({"id": name, "outcome": outcome, "message": text.strip()[:300]})
        else:
            check, figures[name] = _bench_check(out, name, rc)
            checks.append(check)
    goals = {}
    for goal, (step, read, target, higher) in GOALS.items():
        value = None
        if figures.get(step):
            try:
                value = float(read(figures[step]))
            except (KeyError, StopIteration, TypeError, ValueError):
                value = None
        met = None if value is None else (value >= target if higher else value <= target)
        goals[goal] = {"value": value, "goal": f"{'>=' if higher else '<='} {target}", "met": met}
    counts = {k: sum(c["outcome"] == k for c in checks) for k in ("passed", "failed", "skipped")}
    passed = counts["failed"] == 0 and counts["passed"] > 0
    tally = ", ".join(f"{counts[k]} {k}" for k in ("passed", "failed", "skipped"))
    line = f"GPU CHECK {'PASS' if passed else 'FAIL'}: {tally}"
    summary = {
        "verdict": line,
        **counts,
        "goals": goals,
        "steps": steps,
        "wall_s": round(sum(s["seconds"] for s in steps), 1),
        "cap_s": sum(s["cap_s"] for s in steps),
        "checks": checks,
        "figures": figures,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for c in checks:
        if c["outcome"] == "failed":
            print(f"failed: {c['id']}: {c['message']}")
    for goal, g in goals.items():
        shown = (
            "not measured" if g["value"] is None else f"{g['value']:.4g} ({'met' if g['met'] else 'not met'})"
        )
        print(f"goal {goal} {g['goal']}: {shown}")
    print(line)
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_summary")
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install")
    i.add_argument("--wheels", type=Path, required=True)
    i.add_argument("--target", type=Path, required=True)
    v = sub.add_parser("verdict")
    v.add_argument("out", type=Path)
    args = p.parse_args(argv)
    return install(args.wheels, args.target) if args.cmd == "install" else verdict(args.out)


if __name__ == "__main__":
    sys.exit(main())
