"""CLI contract: --help everywhere, one-line errors with exit code 2, the commands' outputs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
    ],
)
def test_bad_input_is_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert fragment in err and len(err.splitlines()) == 1 and "Traceback" not in err


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
