"""CLI contract: --help everywhere, one-line errors with exit code 2, the commands' outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from jobs.cli import build_parser, main

COMMANDS = sorted(build_parser()._subparsers._group_actions[0].choices)


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jobs.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


@pytest.mark.parametrize("command", COMMANDS)
def test_help(command, capsys):
    if command == "lm-eval":  # forwards every argument to lm-eval's own command line
        assert main([command, "--help"]) == 0
        assert "usage" in capsys.readouterr().out.lower()
        return
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert "usage: ernie5" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["params", "--config", "nope"], "unknown preset 'nope'"),
        (["params", "--config", "micro", "--subnet", "d0"], "depth=0"),
        (["params", "--config", "micro", "--subnet", "k99"], "top_k=99"),
        (["params", "--config", "micro", "--set", "model.d_model=abc"], "model.d_model"),
        (["params"], "exactly one of --config or --checkpoint"),
        (["params", "--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
        (
            ["train", "--config", "micro", "--out", "/tmp/x", "--set", "train.stepz=3"],
            "unknown key 'train.stepz'",
        ),
        (["generate", "--checkpoint", "/nonexistent", "--prompt", "hi"], "/nonexistent"),
        (["bench", "train", "--grad-accum", "0"], "--grad-accum 0: expected an integer >= 1"),
        (["bench", "moe", "--repeats", "0"], "--repeats 0: expected an integer >= 1"),
        (["bench", "moe", "--grad-accum", "2"], "applies to `bench train`"),
        (["bench", "train", "--decoding", "greedy"], "--decoding applies to `bench decode`"),
        (["bench", "moe", "--device", "tpu"], "--device 'tpu': expected cpu or cuda[:N]"),
        (["bench", "moe", "--device", "cuda:x"], "--device 'cuda:x': expected cpu or cuda[:N]"),
        (["bench", "decode", "--device", "cuda:7"], "--device 'cuda:7': this machine has"),
        (["bench", "train", "--device", "cuda"], "--device 'cuda': "),
        (
            ["generate", "--checkpoint", "/nonexistent", "--prompt", "hi", "--max-new-tokens", "-5"],
            "--max-new-tokens -5: expected an integer >= 1",
        ),
        (
            ["generate", "--checkpoint", "/nonexistent", "--prompt", "hi", "--max-new-tokens", "0"],
            "--max-new-tokens 0: expected an integer >= 1",
        ),
        (
            ["generate", "--checkpoint", "/nonexistent", "--prompt", "hi", "--temperature", "-1"],
            "--temperature -1.0: expected a number >= 0",
        ),
        (
            ["generate", "--checkpoint", "/nonexistent", "--prompt", "hi", "--temperature", "nan"],
            "--temperature nan: expected a number >= 0",
        ),
        (
            [
                "sweep",
                "--checkpoint",
                "/nonexistent",
                "--suite",
                "smoke",
                "--out",
                "/nonexistent/o",
                "--limit",
                "0",
            ],
            "--limit 0: expected an integer >= 1",
        ),
        (
            ["tasks", "--data-dir", "/nonexistent/data"],
            "--data-dir '/nonexistent/data' does not exist; expected the data root folder",
        ),
        (
            [
                "sweep",
                "--checkpoint",
                "/nonexistent",
                "--suite",
                "smoke",
                "--out",
                "/nonexistent/o",
                "--data-dir",
                "/nonexistent/data",
            ],
            "--data-dir '/nonexistent/data' does not exist",
        ),
        (
            ["train", "--config", "micro", "--out", "/nonexistent/o", "--data-dir", "/nonexistent/data"],
            "--data-dir '/nonexistent/data' does not exist",
        ),
        (["params", "--config", "./micro"], "config file not found: ./micro"),
        (["params", "--config", "micro.yaml"], "config file not found: micro.yaml"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and "Traceback" not in err


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ernie5 {command}: error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("via", ["--data-dir", "ERNIE5_DATA_DIR"])
def test_a_data_root_that_is_a_file_is_bad_input(via, tmp_path, monkeypatch, capsys):
    """Not taken for "no data" (then every data task is skipped and the command exits 0)."""
    root = tmp_path / "data.tar"
    root.write_text("an archive, not a folder")
    if via == "--data-dir":
        assert main(["tasks", "--data-dir", str(root), "--json"]) == 2
    else:
        monkeypatch.setenv("ERNIE5_DATA_DIR", str(root))
        assert main(["tasks", "--json"]) == 2
    err = _one_line_error(capsys, "tasks")
    assert f"{via if via == '--data-dir' else '$' + via} {str(root)!r} is not a folder" in err


def _out_argv(command: str, out: str, tmp_path) -> list[str]:
    ckpt = str(tmp_path / "no-ckpt")
    return {
        "train": ["train", "--config", "micro", "--out", out, "--quiet", "--set", "train.steps=1"],
        "train-vision-tokenizer": ["train-vision-tokenizer", "--out", out, "--set", "steps=1"],
        "sweep": ["sweep", "--checkpoint", ckpt, "--suite", "smoke", "--out", out, "--quiet"],
        "report": ["report", str(tmp_path), "--out", out],
        "extract": ["extract", "--checkpoint", ckpt, "--subnet", "k1", "--out", out],
        "compare": ["compare", str(tmp_path), str(tmp_path), "--out", out],
        "nightly": ["nightly", "--checkpoint", ckpt, "--out", out, "--quiet"],
    }[command]


OUT_COMMANDS = ["train", "train-vision-tokenizer", "sweep", "report", "extract", "compare", "nightly"]


@pytest.mark.parametrize("command", OUT_COMMANDS)
@pytest.mark.parametrize("where", ["under a file", "a file"])
def test_an_out_that_cannot_be_a_folder_is_bad_input(command, where, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("keep me")
    out = blocker / "run" if where == "under a file" else blocker
    assert main(_out_argv(command, str(out), tmp_path)) == 2
    err = _one_line_error(capsys, command)
    if where == "under a file":
        assert f"--out {out}: cannot be created: {blocker} is not a folder" in err
    else:
        assert f"--out {out}: exists and is not a folder" in err
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("command", OUT_COMMANDS)
def test_an_unwritable_out_is_bad_input_before_any_work(command, tmp_path, monkeypatch, capsys):
    import jobs.cli

    # As root every folder is writable, so the permission bits are stubbed; the check is the same.
    monkeypatch.setattr(jobs.cli.os, "access", lambda path, mode: False)
    out = tmp_path / "new" / "run"
    assert main(_out_argv(command, str(out), tmp_path)) == 2
    err = _one_line_error(capsys, command)
    assert f"--out {out}: cannot be created: {tmp_path} is not writable" in err
    assert not (tmp_path / "new").exists()


def test_a_file_system_error_while_writing_is_one_line(tmp_path, monkeypatch, capsys):
    import evals.sweep

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/ro/run/units/full")

    monkeypatch.setattr(evals.sweep, "run_sweep", denied)
    argv = ["sweep", "--checkpoint", "c", "--suite", "smoke", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    assert "Permission denied: /ro/run/units/full" in _one_line_error(capsys, "sweep")

    def broken(*args, **kwargs):
        raise OSError("not about a file")

    monkeypatch.setattr(evals.sweep, "run_sweep", broken)
    with pytest.raises(OSError, match="not about a file"):  # a real failure keeps its traceback
        main(argv)


def test_presets_are_names_first(tmp_path, monkeypatch, capsys):
    """A folder named like a preset (`--out nano_all` of the README's recipe) does not shadow it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "micro").mkdir()
    (tmp_path / "nano_all").mkdir()
    (tmp_path / "nano").write_text("not a config")
    for name in ("micro", "nano_all", "nano"):
        assert main(["params", "--config", name, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["total_params"] > 0
    (tmp_path / "mine").write_text("model: {}\n")
    assert main(["params", "--config", "mine"]) == 2  # a bare name is a name, even if a file has it
    assert "unknown preset 'mine'" in _one_line_error(capsys, "params")
    (tmp_path / "mine.yaml").write_text("model: {}\n")
    assert main(["params", "--config", "mine.yaml", "--json"]) == 0


def test_every_exit_code_is_documented(capsys):
    from pathlib import Path

    from jobs.cli import EXIT_CODES

    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "exit codes:" in help_text
    for code, what in EXIT_CODES.items():
        assert f"  {code:<4} {what.split()[0]}" in help_text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    paragraph = " ".join(readme[readme.index("Exit codes") :].split("\n\n")[0].split())
    phrases = {
        0: "0 success",
        1: "1 `compare --fail-on-regression`",
        2: "2 bad input",
        3: "3 evaluation failed",
        4: "4 training diverged",
        130: "130 interrupted",
        143: "143 preempted",
        141: "141 stdout closed",
    }
    assert set(phrases) == set(EXIT_CODES)
    assert all(phrase in paragraph for phrase in phrases.values()), paragraph


def test_each_exit_code_class(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import jobs.commands.models
    import jobs.nightly
    import reports

    assert main(["params", "--config", "micro", "--json"]) == 0
    regression = SimpleNamespace(summary_markdown="md", out_dir=tmp_path, has_regression=True)
    monkeypatch.setattr(reports, "compare_runs", lambda *a: regression)
    assert main(["compare", "a", "b", "--fail-on-regression"]) == 1
    assert main(["compare", "a", "b"]) == 0
    assert main(["params", "--config", "nope"]) == 2
    failed = {"failed_units": ["k1/arith_d1: RuntimeError: boom"], "units": 2, "run_dir": str(tmp_path)}
    monkeypatch.setattr(jobs.nightly, "run_nightly", lambda **kw: failed)
    capsys.readouterr()
    assert main(["nightly", "--checkpoint", "c", "--quiet"]) == 3
    err = _one_line_error(capsys, "nightly")
    assert "1 of 2 units failed (first: k1/arith_d1: RuntimeError: boom)" in err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(jobs.commands.models, "cmd_params", interrupted)
    assert main(["params", "--config", "micro"]) == 130


def test_the_unsafe_code_flag_reaches_the_sweep(tmp_path, monkeypatch, capsys):
    import evals.sweep
    import jobs.nightly

    seen = []

    def sweep(*args, **kwargs):
        seen.append(kwargs["confirm_run_unsafe_code"])
        return evals.sweep.SweepSummary(tmp_path, 0)

    monkeypatch.setattr(evals.sweep, "run_sweep", sweep)
    argv = ["sweep", "--checkpoint", "c", "--suite", "smoke", "--out", str(tmp_path / "run"), "--quiet"]
    assert main(argv) == 0 and main([*argv, "--confirm-run-unsafe-code"]) == 0
    assert seen == [False, True]
    nightly = []

    def run_nightly(**kwargs):
        nightly.append(kwargs["confirm_run_unsafe_code"])
        return {"failed_units": [], "units": 0, "run_dir": str(tmp_path)}

    monkeypatch.setattr(jobs.nightly, "run_nightly", run_nightly)
    assert main(["nightly", "--checkpoint", "c"]) == 0
    assert main(["nightly", "--checkpoint", "c", "--confirm-run-unsafe-code"]) == 0
    assert nightly == [False, True]


def test_bad_kernels_setting_is_one_line_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("ERNIE5_KERNELS", "turbo")
    assert main(["params", "--config", "micro"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ERNIE5_KERNELS='turbo'" in err and "auto, on or off" in err and len(err.splitlines()) == 1


def test_argparse_errors_exit_2():
    r = _run("params", "--seq-len", "many")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_params_json(capsys):
    assert main(["params", "--config", "nano", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"total_params", "active_params", "activation_rate", "flops_per_token"} <= set(rep)
    assert main(["params", "--config", "paper", "--json", "--subnet", "k0.25"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["total_params"] > 1e12 and rep["top_k"] == 2


def test_train_extract_generate_params_on_a_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--config",
                "micro",
                "--out",
                str(run),
                "--quiet",
                "--set",
                "train.steps=6",
                "--set",
                "data.tokenizer_chars=20000",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["params", "--checkpoint", str(run), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    out = tmp_path / "sub"
    assert main(["extract", "--checkpoint", str(run), "--subnet", "d0.5-w0.5-k1", "--out", str(out)]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["total_params"] < rep["parent_total_params"] and rep["file_bytes"] < rep["parent_file_bytes"]
    assert main(["params", "--checkpoint", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_params"] == rep["total_params"] < full["total_params"]
    assert (
        main(["extract", "--checkpoint", str(run), "--subnet", "k1", "--out", str(out)]) == 2
    )  # no overwrite
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(out),
                "--prompt",
                "Q: 1+1=",
                "--max-new-tokens",
                "5",
                "--speculative",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    assert "acceptance_rate" in captured.err
    too_long = ["generate", "--checkpoint", str(out), "--prompt", "Q: 1+1=", "--max-new-tokens", "100000"]
    assert main(too_long) == 2
    err = _one_line_error(capsys, "generate")
    assert "max_new_tokens=100000" in err and "max_seq_len=" in err
    assert main([*too_long, "--speculative"]) == 2
    _one_line_error(capsys, "generate")


def test_a_closed_output_pipe_exits_quietly(tmp_path):
    import subprocess
    import sys

    # `ernie5 params --json | head -c 0`: the reader is gone before the JSON is written.
    code = "import sys; from jobs.cli import main; sys.exit(main(['params', '--config', 'micro', '--json']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--config", "micro", "--device", "cuda"], "train.device: device='cuda', but no CUDA GPU"),
        (["train", "--config", "micro", "--set", "train.fp8=true"], "train.fp8 needs a CUDA GPU"),
        (
            ["sft", "--checkpoint", "reference", "--device", "cuda"],
            "train.device: device='cuda', but no CUDA",
        ),
        (
            ["rl", "--checkpoint", "reference", "--device", "cuda"],
            "rl.device: device='cuda', but no CUDA GPU",
        ),
    ],
    ids=["train", "train-fp8", "sft", "rl"],
)
def test_a_device_the_machine_lacks_is_one_line_before_anything_is_written(argv, message, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*argv, "--out", str(out)]) == 2
    assert message in _one_line_error(capsys, argv[0])
    assert not out.exists()


@pytest.mark.parametrize(
    ("command", "key"), [("train", "train.device"), ("sft", "train.device"), ("rl", "rl.device")]
)
def test_device_is_the_config_key_and_wins_over_a_set_of_it(command, key):
    from jobs.commands.common import load_run_config, with_device

    source = ["--config", "micro"] if command == "train" else ["--checkpoint", "reference"]
    args = build_parser().parse_args(
        [command, "--out", "o", *source, "--set", f"{key}=cuda", "--device", "cpu"]
    )
    assert with_device(args, key) == [f"{key}=cuda", f"{key}=cpu"]
    assert with_device(build_parser().parse_args([command, "--out", "o", *source]), key) == []
    if command == "train":  # the later override wins
        assert load_run_config("micro", with_device(args, key)).train.device == "cpu"


def test_nothing_is_skipped_silently(tmp_path, capsys):
    """sft without its data root trained on 4 of 12 sources and said so only in a log; every skipped
    source or task is now named on stderr with how to supply it, and --strict makes a skip exit 2."""
    empty = tmp_path / "empty_root"
    empty.mkdir()
    args = ["train", "--config", "micro", "--data-dir", str(empty), "--quiet"]
    for item in (
        "data.tokenizer_chars=20000",
        "train.steps=2",
        "data.sources={shakespeare: 0.5, procedural: 0.5}",
    ):
        args += ["--set", item]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "ernie5 train: trained without 1 data source(s):" in err and "  shakespeare: " in err
    assert main([*args, "--out", str(tmp_path / "b"), "--strict"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.strict: 1 source(s) have no data (first: shakespeare" in err[0]
    assert not (tmp_path / "b").exists()
    sweep = [
        "sweep",
        "--checkpoint",
        "reference",
        "--suite",
        "smoke",
        "--data-dir",
        str(empty),
        "--quiet",
        "--limit",
        "2",
    ]
    assert main([*sweep, "--out", str(tmp_path / "s")]) == 0
    err = capsys.readouterr().err
    assert "ernie5 sweep: skipped " in err and "task(s):" in err
    assert main([*sweep, "--out", str(tmp_path / "s2"), "--strict"]) == 2
    assert "--strict: " in capsys.readouterr().err


@pytest.mark.parametrize("command", ["sft", "rl"])
def test_sft_and_rl_check_their_trackers_before_any_work(command, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([command, "--checkpoint", "reference", "--out", str(out), "--log-with", "neptune"]) == 2
    assert "--log-with 'neptune': expected one of tensorboard, wandb, mlflow" in capsys.readouterr().err
    assert not out.exists()
