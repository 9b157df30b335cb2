"""Side trainers stop on SIGTERM with a resume state and continue bit-identically (train.side.resume)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ernie5.config import ConfigError
from ernie5.runtime.preempt import EXIT_PREEMPTED, Preempted, Preemption
from ernie5.tokenizers.vision import VisionTokenizerConfig
from tests.train.side.test_audio_codec import tiny_train_cfg as tiny_codec
from tests.train.side.test_refiner import TINY as TINY_REFINER
from tests.train.side.test_speech_content import tiny as tiny_speech
from train.side.audio_codec import train_audio_codec
from train.side.refiner import RefinerTrainConfig, train_refiner
from train.side.resume import RESUME_FILE, ResumeConfig, SideRun
from train.side.speech_content import train_speech_content
from train.side.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def tiny_vision(**overrides) -> VisionTokenizerTrainConfig:
    base = dict(
        tokenizer=VisionTokenizerConfig(base_channels=8, latent_bits=6),
        steps=6,
        batch_size=4,
        bits_schedule=((0.0, 4), (0.5, 6)),
        video_steps=4,
        video_batch_size=2,
        video_frames=2,
        video_image_batch_size=2,
        eval_images=4,
        eval_clips=2,
        log_every=1,
    )
    return VisionTokenizerTrainConfig(**(base | overrides))


def tiny_refiner(**overrides) -> RefinerTrainConfig:
    base = dict(
        refiner=replace(TINY_REFINER, sample_steps=2),
        steps=6,
        batch_size=4,
        eval_images=4,
        eval_steps=(1,),
        log_every=2,
    )
    return RefinerTrainConfig(**(base | overrides))


def _stop_at(monkeypatch, phase: str, step: int) -> None:
    """Ask for a stop (as SIGTERM does) just before ``step`` of ``phase`` is reported done."""
    original = SideRun.step_done

    def step_done(self, ph, k, objects, extras=None):
        if (ph, k) == (phase, step):
            self.stop.request("SIGTERM")
        return original(self, ph, k, objects, extras)

    monkeypatch.setattr(SideRun, "step_done", step_done)


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.rglob("*.safetensors")):
        out |= {f"{f.relative_to(folder)}:{k}": v for k, v in load_file(f).items()}
    assert out, f"no weights under {folder}"
    return out


def _metrics(folder: Path) -> list[dict]:
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "elapsed_s"} for r in records]


def _assert_same_run(a: Path, b: Path, parts: list[str]) -> None:
    for part in parts:
        wa, wb = _weights(a / part), _weights(b / part)
        assert wa.keys() == wb.keys()
        for k in wa:
            assert torch.equal(wa[k], wb[k]), f"{part}: {k} differs after resume"
    assert _metrics(a) == _metrics(b)
    assert not (b / RESUME_FILE).exists()


def _interrupted_then_resumed(monkeypatch, train, phase: str, step: int, out: Path) -> None:
    with monkeypatch.context() as m:
        _stop_at(m, phase, step)
        with pytest.raises(Preempted, match=f"SIGTERM at {phase} step {step}"):
            train(out)
    assert (out / RESUME_FILE).is_file()
    train(out)


@pytest.fixture(scope="module")
def no_data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("no-data")


@pytest.mark.parametrize(("phase", "step"), [("2d", 3), ("2d", 6), ("3d", 2)])
def test_vision_tokenizer_resumes_bit_identically(tmp_path, monkeypatch, no_data, phase, step):
    def train(out):
        return train_vision_tokenizer(tiny_vision(), out, data_dir=no_data)

    train(tmp_path / "whole")
    _interrupted_then_resumed(monkeypatch, train, phase, step, tmp_path / "resumed")
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed", ["tokenizer_2d", "tokenizer_3d"])


def test_audio_codec_resumes_bit_identically(tmp_path, monkeypatch, no_data):
    cfg = tiny_codec(steps=5)

    def train(out):
        return train_audio_codec(cfg, out, data_dir=no_data)

    train(tmp_path / "whole")
    _interrupted_then_resumed(monkeypatch, train, "codec", 2, tmp_path / "resumed")
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed", ["codec"])


def test_refiner_resumes_bit_identically(tmp_path, monkeypatch, no_data):
    def train(out):
        return train_refiner(tiny_refiner(), out, data_dir=no_data)

    train(tmp_path / "whole")
    _interrupted_then_resumed(monkeypatch, train, "refiner", 3, tmp_path / "resumed")  # mid log window
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed", ["refiner"])


def test_speech_encoder_resumes_bit_identically(tmp_path, monkeypatch, data_root):
    if not (data_root / "fsdd" / "recordings").is_dir():
        pytest.skip(f"no FSDD under {data_root}")
    cfg = tiny_speech(steps=4)

    def train(out):
        return train_speech_content(cfg, out, data_dir=data_root)

    train(tmp_path / "whole")
    _interrupted_then_resumed(monkeypatch, train, "ctc", 2, tmp_path / "resumed")
    _assert_same_run(tmp_path / "whole", tmp_path / "resumed", ["encoder"])


def test_periodic_states_and_a_kill_resume_from_the_last_one(tmp_path, no_data):
    """``resume.every`` writes states as it goes; a run killed after one (here: the state copied aside
    and put back, as a ``kill -9`` would leave it) continues from it to the same end."""
    cfg = tiny_refiner(resume=ResumeConfig(every=2))
    seen: list[int] = []
    original = SideRun.save

    def save(self, phase, step, objects, extras=None):
        original(self, phase, step, objects, extras)
        seen.append(step)
        if step == 4:
            (tmp_path / "kept.pt").write_bytes(self.path.read_bytes())
            (tmp_path / "kept.jsonl").write_bytes((self.out / "metrics.jsonl").read_bytes())

    mp = pytest.MonkeyPatch()
    mp.setattr(SideRun, "save", save)
    try:
        train_refiner(cfg, tmp_path / "whole", data_dir=no_data)
    finally:
        mp.undo()
    assert seen == [2, 4]
    assert not (tmp_path / "whole" / RESUME_FILE).exists()
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / RESUME_FILE).write_bytes((tmp_path / "kept.pt").read_bytes())
    with open(killed / "metrics.jsonl", "wb") as f:  # a record logged after the state, then the kill
        f.write((tmp_path / "kept.jsonl").read_bytes() + b'{"step": 99}\n')
    train_refiner(cfg, killed, data_dir=no_data)
    _assert_same_run(tmp_path / "whole", killed, ["refiner"])


def test_every_kind_of_state_round_trips(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    objects = {
        "model": model,
        "opt": opt,
        "rng": random.Random(1),
        "np": np.random.default_rng(2),
        "gen": torch.Generator().manual_seed(3),
    }
    run = SideRun(tmp_path, "cfg: 1\n", ResumeConfig(), Preemption(60))
    run.save("p", 7, objects, {"window": [1.5, 2.5]})
    expected = (objects["rng"].random(), objects["np"].random(), torch.rand(1, generator=objects["gen"]))
    torch_next = torch.rand(1)

    fresh = {
        "model": torch.nn.Linear(3, 2),
        "opt": None,
        "rng": random.Random(0),
        "np": np.random.default_rng(0),
        "gen": torch.Generator(),
    }
    fresh["opt"] = torch.optim.AdamW(fresh["model"].parameters(), lr=0.1)
    again = SideRun(tmp_path, "cfg: 1\n", ResumeConfig(), Preemption(60))
    assert again.phase == "p"
    assert again.restore("other", fresh) == (0, {})
    assert again.restore("p", fresh) == (7, {"window": [1.5, 2.5]})
    assert torch.equal(fresh["model"].weight, model.weight)
    assert fresh["opt"].state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    got = (fresh["rng"].random(), fresh["np"].random(), torch.rand(1, generator=fresh["gen"]))
    assert got == expected and torch.equal(torch.rand(1), torch_next)


def test_a_state_from_another_config_or_a_broken_file_is_one_line(tmp_path):
    SideRun(tmp_path, "a: 1\n", ResumeConfig(), Preemption(60)).save("p", 1, {"r": random.Random(0)})
    with pytest.raises(ConfigError, match="another config.*delete it"):
        SideRun(tmp_path, "a: 2\n", ResumeConfig(), Preemption(60))
    (tmp_path / RESUME_FILE).write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match="unreadable resume state"):
        SideRun(tmp_path, "a: 1\n", ResumeConfig(), Preemption(60))


def test_a_fresh_run_clears_old_metrics_and_bad_settings_are_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    SideRun(tmp_path, "", ResumeConfig(), Preemption(60))
    assert not (tmp_path / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="resume.every=-1"):
        ResumeConfig(every=-1)
    with pytest.raises(ValueError, match="resume.grace_s=0"):
        ResumeConfig(grace_s=0)


@pytest.mark.slow  # a real subprocess end to end; the in-process tests above cover the resume exactly
def test_sigterm_to_a_real_side_trainer_then_the_same_command_continues(tmp_path, no_data):
    """A real ``SIGTERM`` to ``ernie5 train-vision-tokenizer`` mid-run: exit 143 with one line and a
    resume state; the same command then finishes with the weights of an uninterrupted run."""
    sets = ["tokenizer.base_channels=8", "tokenizer.latent_bits=6", "bits_schedule=[[0.0,4],[0.5,6]]"]
    sets += ["steps=400", "batch_size=4", "video_steps=2", "video_batch_size=2", "video_frames=2"]
    sets += ["video_image_batch_size=2", "eval_images=4", "eval_clips=2", "log_every=1"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "jobs.cli", "train-vision-tokenizer", "--out", str(out)]
    cmd += ["--data-dir", str(no_data), *[x for s in sets for x in ("--set", s)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, stderr
    lines = [x for x in stderr.splitlines() if x.startswith("ernie5 train-vision-tokenizer")]
    assert len(lines) == 1 and "preempted: SIGTERM at 2d step" in lines[0] and RESUME_FILE in lines[0]
    assert (out / RESUME_FILE).is_file() and not (out / "tokenizer_2d").exists()

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    cfg = tiny_vision(steps=400, video_steps=2)
    torch.set_num_threads(1)
    train_vision_tokenizer(cfg, tmp_path / "whole", data_dir=no_data)
    _assert_same_run(tmp_path / "whole", out, ["tokenizer_2d", "tokenizer_3d"])


def test_the_cli_still_refuses_a_used_folder_without_a_resume_state(tmp_path, capsys):
    from jobs.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "something").write_text("x")
    assert main(["train-refiner", "--out", str(tmp_path / "run")]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err


def test_the_recipe_keeps_a_stopped_side_stage_and_continues_it(tmp_path):
    from jobs.recipe import _stage

    calls: list[bool] = []

    def train(tmp: Path) -> None:
        calls.append((tmp / RESUME_FILE).is_file())
        tmp.mkdir(parents=True, exist_ok=True)
        if len(calls) == 1:
            (tmp / RESUME_FILE).write_bytes(b"state")
            raise Preempted("SIGTERM")
        (tmp / RESUME_FILE).unlink()
        (tmp / "done").write_text("ok")

    with pytest.raises(Preempted):
        _stage(tmp_path / "vision", lambda d: (d / "done").is_file(), train, "vision tokenizer", True)
    assert _stage(tmp_path / "vision", lambda d: (d / "done").is_file(), train, "vision tokenizer", True)
    assert calls == [False, True] and (tmp_path / "vision" / "done").is_file()


def test_two_side_trainers_into_one_folder_get_the_lock_error(tmp_path, no_data):
    from ernie5.store.runs import RunLock, RunLocked

    with RunLock(tmp_path / "run"), pytest.raises(RunLocked, match="is being written"):
        train_refiner(tiny_refiner(), tmp_path / "run", data_dir=no_data)
