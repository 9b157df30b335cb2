"""Data parallel under ``accelerate launch --multi_gpu`` (torchrun; on a CPU-only machine the
processes join a gloo group: 2 CPU processes here) and kill -9 resume."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import cli_env

COMMON = [
    "--config",
    "micro",
    "--quiet",
    "--set",
    "train.steps=12",
    "--set",
    "train.log_every=1",
    "--set",
    "train.ckpt_every=4",
    "--set",
    "data.tokenizer_chars=20000",
    "--set",
    "train.threads=1",
]


_env = cli_env


def _losses(run: Path):
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _one_process_accumulating_two(out: Path, *args: str) -> Path:
    """The one-process reference of a two-process run: two micro-batches per step, sharing one sampled
    sub-model as the two processes' concurrent micro-batches do (``ernie5 train`` with ``COMMON``,
    then ``args``)."""
    cmd = [sys.executable, "-m", "jobs.cli", "train", "--out", str(out), *COMMON, *args]
    cmd += ["--set", "train.grad_accum=2", "--set", "train.parallel.subnet_group=2"]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


@pytest.mark.slow
def test_two_process_run_equals_one_process_with_double_accumulation(tmp_path):
    accelerate = Path(sys.executable).with_name("accelerate")
    dp = tmp_path / "dp"
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",  # the README's documented one-node config, on 2 CPU processes
        str(Path(__file__).resolve().parents[3] / "launch" / "one_node.yaml"),
        "--num_processes",
        "2",
        "-m",
        "jobs.cli",
        "train",
        "--out",
        str(dp),
        *COMMON,
    ]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    single = _one_process_accumulating_two(tmp_path / "single")
    a, b = _losses(dp), _losses(single)
    assert len(a) == len(b) == 12
    assert a == pytest.approx(b, rel=1e-5)  # gradient sums differ only in float summation order
    recs = [json.loads(x) for x in (dp / "metrics.jsonl").read_text().splitlines()]
    assert len(recs[0]["subnets"]) == 2  # both processes' micro-batches are logged


@pytest.mark.slow
def test_kill_9_at_a_random_moment_then_resume_matches_a_straight_run(tmp_path):
    straight = tmp_path / "straight"
    r = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "train", "--out", str(straight), *COMMON],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    killed = tmp_path / "killed"
    rng = random.Random(0)
    for attempt in range(3):  # kill a few times at random moments, resuming in between
        cmd = [sys.executable, "-m", "jobs.cli", "train", "--out", str(killed), *COMMON]
        if attempt or (killed / "config.yaml").exists():
            cmd.append("--resume")
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(2.0, 6.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
    r = subprocess.run(
        [sys.executable, "-m", "jobs.cli", "train", "--out", str(killed), *COMMON, "--resume"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert _losses(killed) == _losses(straight)
    shutil.rmtree(tmp_path, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_launched_with_the_multi_node_config_equal_one_process(tmp_path):
    """The README's several-node launch (``launch/multi_node.yaml``), as two "nodes" of one CPU process
    each on this machine (node ranks 0 and 1, rendezvous at 127.0.0.1), with the experts split over the
    nodes (``train.parallel.ep=2``): the same losses as one process accumulating both nodes' batches."""
    accelerate = Path(sys.executable).with_name("accelerate")
    config = Path(__file__).resolve().parents[3] / "launch" / "multi_node.yaml"
    run, port = tmp_path / "run", str(_free_port())
    steps = ["--set", "train.steps=6", "--set", "train.parallel.ep=2"]
    nodes = [
        subprocess.Popen(
            [
                str(accelerate),
                "launch",
                "--config_file",
                str(config),
                "--machine_rank",
                str(rank),
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                "-m",
                "jobs.cli",
                "train",
                "--out",
                str(run),
                *COMMON,
                *steps,
            ],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for rank in (0, 1)
    ]
    for rank, node in enumerate(nodes):
        _, err = node.communicate(timeout=600)
        assert node.returncode == 0, f"node {rank}: {err[-2000:]}"
    assert json.loads((run / "meta.json").read_text())["world_size"] == 2
    single = _one_process_accumulating_two(tmp_path / "single", "--set", "train.steps=6")
    a, b = _losses(run), _losses(single)
    assert len(a) == len(b) == 6
    assert a == pytest.approx(b, rel=1e-5)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["a2a_bytes_per_step"] > 0 for r in recs)  # tokens crossed the nodes to their experts
