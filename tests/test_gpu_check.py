"""``launch/gpu_check.sh``, the one prepared script of the GPU checks, can only run where a GPU is
lent, briefly: its commands must not fail on a typo. Every ``ernie5`` command in it parses with the
CLI's own parser and every test file it names exists."""

from __future__ import annotations

import shlex
from pathlib import Path

from jobs.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "gpu_check.sh"


def _commands() -> list[list[str]]:
    """The script's commands as words, continuation lines joined, redirections and limits dropped."""
    text = SCRIPT.read_text(encoding="utf-8").replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        words = shlex.split(line, comments=True)
        for stop in (">", "2>", "|"):
            if stop in words:
                words = words[: words.index(stop)]
        out.append(words)
    return out


def test_every_ernie5_command_of_the_gpu_script_parses():
    parser = build_parser()
    benches = []
    for words in _commands():
        if "ernie5" in words:
            argv = words[words.index("ernie5") + 1 :]
            args = parser.parse_args(argv)  # SystemExit (a failed test) on an unknown flag
            benches.append((args.command, args.what, args.device))
    assert {what for _, what, _ in benches} >= {"moe", "train", "decode"}
    assert all(cmd == "bench" and device == "cuda" for cmd, _, device in benches)


def test_the_gpu_script_runs_test_files_that_exist_and_the_model_tests():
    named = [w for words in _commands() for w in words if w.startswith("tests/")]
    assert "tests/model/test_cuda.py" in named
    assert "tests/train/pretrain/parallel/test_cuda.py" in named
    for path in named:
        assert (ROOT / path).is_file(), path
