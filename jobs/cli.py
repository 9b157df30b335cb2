"""The one command-line entry: ``ernie5 <command>``.

Each subcommand parses its arguments and calls one library function. Bad input is a one-line
``ernie5 <command>: error: ...`` on stderr with exit code 2 and no traceback; :data:`EXIT_CODES`
lists every exit code (``ernie5 --help`` prints them).

It sits on the top layer (``jobs``), above ``train``, ``evals`` and ``reports``, which it imports
lazily inside the command handlers so that ``ernie5 --help`` stays fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_BAD_INPUT = 2
EXIT_EVAL_FAILED = 3
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_REGRESSION: "`compare --fail-on-regression` found a significant regression",
    EXIT_BAD_INPUT: "bad input: an argument, config, suite, checkpoint, data root or --out that cannot be "
    "used, or a file that cannot be read or written (one line on stderr, nothing already written lost)",
    EXIT_EVAL_FAILED: "evaluation failed: `sweep` or `nightly` recorded at least one unit as an error "
    "(tables and report are still written; units.csv and units/ hold the messages)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_BROKEN_PIPE: "stdout was closed by its reader (e.g. `| head`)",
}
"""Every exit code of ``ernie5`` and what it means (the ``--help`` epilog and the README list them)."""


class CLIError(Exception):
    """A user error reported as one line with exit code 2."""


def _user_errors() -> tuple[type[BaseException], ...]:
    from ernie5.config import ConfigError
    from ernie5.data.root import DataDirError, DataMissing
    from ernie5.data.voices import VoicesUnavailable
    from ernie5.generation.text import GenerationError
    from ernie5.store.checkpoint import CheckpointError
    from ernie5.subnets.spec import SubnetError
    from ernie5.tokenizers.text import TokenizerError

    errors: list[type[BaseException]] = [
        CLIError,
        ConfigError,
        SubnetError,
        CheckpointError,
        DataMissing,
        DataDirError,
        GenerationError,
        TokenizerError,
        VoicesUnavailable,
    ]
    from ernie5.data.text import DataCorrupt
    from ernie5.tokenizers.refiner import RefinerError
    from ernie5.tokenizers.vision import VisionTokenizerError
    from evals.adapter import EvalInputError
    from evals.results import RunLocked
    from evals.verifiers import VerifierError
    from reports.load import ReportError
    from train.common.run_folder import RunError

    errors += [DataCorrupt, EvalInputError, RunError, ReportError, RefinerError, VisionTokenizerError]
    errors.append(VerifierError)
    return (*errors, RunLocked)


def _check_out(out: str | Path, flag: str = "--out") -> Path:
    """``out`` as a Path if it can be a folder this process writes, else a :class:`CLIError` naming it:
    checked before any work, so that hours of training or evaluation do not end in a traceback."""
    p = Path(out)
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        where = "exists and is not a folder" if probe == p else f"cannot be created: {probe} is not a folder"
        raise CLIError(f"{flag} {out}: {where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable" if probe == p else f"cannot be created: {probe} is not writable"
        raise CLIError(f"{flag} {out}: {what}")
    return p


def _os_error_line(e: OSError) -> str:
    """One line for a file-system error: what failed on which path."""
    paths = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
    return f"{e.strerror or type(e).__name__}: {paths}"


# ---------------------------------------------------------------------------- helpers
def _load_run_config(config: str, overrides: list[str]):
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from train.pretrain.config import RunConfig

    return load(RunConfig, resolve_config_path(config), overrides)


def _load_model_config(args):
    """ModelConfig from --config (preset/file, `model:` section) or --checkpoint (config.yaml)."""
    from ernie5.config import ConfigError, apply_overrides, from_dict, read_yaml
    from ernie5.model.config import ModelConfig
    from ernie5.presets import resolve_config_path

    if args.checkpoint:
        from ernie5.store.checkpoint import resolve_checkpoint

        path = resolve_checkpoint(args.checkpoint)
        data = read_yaml(path / "config.yaml")
        return from_dict(ModelConfig, apply_overrides(data, args.set or [])), path
    data = read_yaml(resolve_config_path(args.config))
    model_data = data.get("model", {})
    if not isinstance(model_data, dict):
        raise ConfigError("model: expected a mapping")
    overrides = [s[len("model.") :] for s in (args.set or []) if s.startswith("model.")]
    bad = [s for s in (args.set or []) if not s.startswith("model.")]
    if bad:
        raise CLIError(f"--set {bad[0]!r}: only model.* keys apply to `params`")
    try:
        return from_dict(ModelConfig, apply_overrides(model_data, overrides)), None
    except ConfigError as e:
        raise ConfigError(f"model.{e}") from None


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


# ---------------------------------------------------------------------------- commands
def _with_device(args, key: str) -> list[str]:
    """The ``--set`` overrides, then ``--device`` as ``key=...`` (it wins over a ``--set`` of it)."""
    return [*(args.set or []), *([f"{key}={args.device}"] if args.device else [])]


def cmd_train(args) -> int:
    """``ernie5 train``."""
    from train.pretrain.loop import pretrain

    _check_out(args.out)
    cfg = _load_run_config(args.config, _with_device(args, "train.device"))
    last = pretrain(cfg, args.out, resume=args.resume, data_dir=args.data_dir, quiet=args.quiet)
    if last and int(os.environ.get("RANK", "0")) == 0:  # one summary for a multi-process run
        print(json.dumps({k: last[k] for k in ("step", "loss", "tokens_per_s", "mfu") if k in last}))
    return 0


def cmd_sft(args) -> int:
    """``ernie5 sft``: supervised fine-tuning of a checkpoint on instruction turns."""
    from train.pretrain.sft import sft

    _check_out(args.out)
    last = sft(
        args.checkpoint,
        args.out,
        config=args.config,
        overrides=_with_device(args, "train.device"),
        resume=args.resume,
        data_dir=args.data_dir,
        quiet=args.quiet,
    )
    if last:
        print(json.dumps({k: last[k] for k in ("step", "loss", "tokens_per_s", "mfu") if k in last}))
    return 0


def cmd_rl(args) -> int:
    """``ernie5 rl``: reinforcement learning from a checkpoint with the harness's tasks as verifiers."""
    from ernie5.data.root import resolve_data_dir
    from train.rl.trainer import rl, rl_config

    _check_out(args.out)
    cfg = rl_config(args.checkpoint, args.config, _with_device(args, "rl.device"))
    data_dir = resolve_data_dir(args.data_dir or cfg.data_dir or None)
    last = rl(cfg, args.out, _verifiers(cfg, data_dir), resume=args.resume, quiet=args.quiet)
    if last:
        keys = ("step", "reward", "entropy", "response_len", "idle_s")
        print(json.dumps({k: last[k] for k in keys if k in last}))
    return 0


def _verifiers(cfg, data_dir):
    import evals.tasks  # noqa: F401  (registers the tasks)
    from evals.verifiers import TaskVerifier

    return {name: TaskVerifier(name, data_dir) for name in cfg.tasks}


def cmd_rl_study(args) -> int:
    """``ernie5 rl-study``: one RL ablation (its arms as RL runs) and its report section."""
    from ernie5.data.root import resolve_data_dir
    from jobs.rl_study import run_study

    _check_out(args.out)
    data_dir = resolve_data_dir(args.data_dir)
    path = run_study(
        args.study,
        args.checkpoint,
        args.out,
        lambda cfg: _verifiers(cfg, data_dir),
        overrides=args.set or [],
        config=args.config,
        quiet=args.quiet,
    )
    print(json.dumps({"report": str(path)}))
    return 0


def cmd_study(args) -> int:
    """``ernie5 study elastic``: the elastic-training study (its models, sweeps and report)."""
    from jobs.elastic_study import load_study_config, run_study

    _check_out(args.out)
    cfg = load_study_config(args.config, args.set or [])
    path = run_study(
        cfg, args.out, data_dir=args.data_dir, resume=args.resume, quiet=args.quiet, argv=sys.argv
    )
    print(json.dumps({"report": str(path)}))
    return 0


def _train_component(args, config_cls, train_fn, **kwargs) -> int:
    """Shared body of the ``train-*`` commands: a new --out folder, a strict config, a JSON summary."""
    from ernie5.config import load

    out = _check_out(args.out)
    if out.exists() and any(out.iterdir()):
        raise CLIError(f"--out {out} already exists and is not empty; choose a new folder")
    cfg = load(config_cls, args.config, args.set or [])
    _print_json(train_fn(cfg, out, args.data_dir, time_budget_s=args.time_budget, **kwargs))
    return 0


def cmd_train_vision_tokenizer(args) -> int:
    """``ernie5 train-vision-tokenizer``."""
    from train.side.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer

    return _train_component(args, VisionTokenizerTrainConfig, train_vision_tokenizer)


def cmd_train_audio_codec(args) -> int:
    """``ernie5 train-audio-codec``."""
    from train.side.audio_codec import AudioCodecTrainConfig, train_audio_codec

    return _train_component(args, AudioCodecTrainConfig, train_audio_codec)


def cmd_train_refiner(args) -> int:
    """``ernie5 train-refiner``."""
    from train.side.refiner import RefinerTrainConfig, train_refiner

    return _train_component(args, RefinerTrainConfig, train_refiner, tokenizer_path=args.tokenizer)


def cmd_recipe(args) -> int:
    """``ernie5 recipe reference``: reproduce (or resume) the shipped reference model."""
    from jobs.recipe import run_recipe

    _check_out(args.out)
    record = run_recipe(
        args.out, args.data_dir, overrides=args.set or [], install=args.install, quiet=args.quiet
    )
    _print_json({"out": args.out, "stages": record["stages"], "inputs_digest": record["inputs_digest"]})
    return 0


def cmd_params(args) -> int:
    """``ernie5 params``."""
    from ernie5.subnets.params import count_params
    from ernie5.subnets.spec import resolve_subnet

    if bool(args.config) == bool(args.checkpoint):
        raise CLIError("give exactly one of --config or --checkpoint")
    cfg, path = _load_model_config(args)
    subnet = resolve_subnet(args.subnet, cfg, path) if args.subnet else None
    report = count_params(cfg, subnet, args.seq_len).to_dict()
    report = {"subnet": subnet.name if subnet else "full", **report}
    if args.json:
        _print_json(report)
    else:
        for k, v in report.items():
            if isinstance(v, float) and k == "activation_rate":
                v = f"{v * 100:.3f} %"
            elif isinstance(v, int | float) and not isinstance(v, bool) and abs(v) >= 1000:
                v = f"{v:,.0f}"
            print(f"{k:28s} {v}")
    return 0


def cmd_extract(args) -> int:
    """``ernie5 extract``."""
    from ernie5.subnets.extract import extract_checkpoint

    out = _check_out(args.out)
    if out.exists():
        raise CLIError(f"--out {out} already exists; choose a new folder (nothing is overwritten)")
    report = extract_checkpoint(args.checkpoint, args.subnet, out, data_dir=args.data_dir)
    _print_json(report)
    return 0


def cmd_generate(args) -> int:
    """``ernie5 generate``."""
    from ernie5.generation.text import generate_text

    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens {args.max_new_tokens}: expected an integer >= 1")
    if not args.temperature >= 0:
        raise CLIError(f"--temperature {args.temperature}: expected a number >= 0 (0 = greedy)")
    text, info = generate_text(
        args.checkpoint,
        args.prompt,
        subnet=args.subnet,
        max_new_tokens=args.max_new_tokens,
        speculative=args.speculative,
        temperature=args.temperature,
        seed=args.seed,
    )
    print(text)
    if info:
        print(json.dumps(info), file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    """``ernie5 bench moe|decode|train``."""
    for name in ("repeats", "grad_accum"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} {getattr(args, name)}: expected an integer >= 1")
    if args.grad_accum != 1 and args.what != "train":
        raise CLIError(f"--grad-accum applies to `bench train`, not `bench {args.what}`")
    if args.decoding is not None and args.what != "decode":
        raise CLIError(f"--decoding applies to `bench decode`, not `bench {args.what}`")
    from ernie5.bench.timing import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if args.activation_checkpoint and args.what != "train":
        raise CLIError(f"--activation-checkpoint applies to `bench train`, not `bench {args.what}`")
    if args.fp8 and args.what != "train":
        raise CLIError(f"--fp8 applies to `bench train`, not `bench {args.what}`")
    if args.fp8:
        from train.pretrain.parallel.fp8 import fp8_supported

        why = fp8_supported(device)
        if why is not None:
            raise CLIError(f"--fp8: {why}")
    if args.what == "moe":
        from ernie5.bench.moe import bench_moe

        result = bench_moe(tokens=args.tokens, repeats=args.repeats, device=device)
    elif args.what == "decode":
        from ernie5.bench.decode import bench_decode

        result = bench_decode(
            repeats=args.repeats,
            new_tokens=args.new_tokens,
            device=device,
            decoding=args.decoding or "sampled",
        )
    else:
        from train.pretrain.bench import bench_train

        result = bench_train(
            repeats=args.repeats,
            peer=args.peer,
            grad_accum=args.grad_accum,
            device=str(device),
            activation_checkpoint=args.activation_checkpoint,
            fp8=args.fp8,
        )
    if args.json:
        _print_json(result)
    else:
        print(json.dumps(result, indent=2))
    return 0


def cmd_tasks(args) -> int:
    """``ernie5 tasks``."""
    from ernie5.data.root import resolve_data_dir
    from evals.catalog import format_table, list_tasks

    rows = list_tasks(resolve_data_dir(args.data_dir))
    if args.json:
        _print_json(rows)
    else:
        print(format_table(rows))
    return 0


def cmd_specialists(args) -> int:
    """``ernie5 specialists``."""
    from ernie5.data.root import resolve_data_dir
    from evals.specialists import suite_specialists

    report = suite_specialists(args.suite, resolve_data_dir(args.data_dir))
    if args.json:
        _print_json(report)
    else:
        for r in report["rows"]:
            print(
                f"{r['task']:24s} {r['metric']:20s} {r['value']:.3f} ± {1.96 * r['stderr']:.3f}  n={r['n']}"
            )
        for s in report["skipped"]:
            print(f"{s['task']:24s} skipped: {s['reason']}")
    return 0


def cmd_sweep(args) -> int:
    """``ernie5 sweep``."""
    from evals.results import LOCK_FILE
    from evals.sweep import run_sweep

    if args.limit is not None and args.limit < 1:
        raise CLIError(f"--limit {args.limit}: expected an integer >= 1")
    out = _check_out(args.out)
    is_run = (out / "units").is_dir() or (out / LOCK_FILE).is_file()
    if out.exists() and any(out.iterdir()) and not args.resume and not is_run:
        raise CLIError(f"--out {out} exists and is not a sweep run folder; choose a new folder")
    summary = run_sweep(
        args.checkpoint,
        args.suite,
        out,
        data_dir=args.data_dir,
        limit=args.limit,
        cache_path=args.cache,
        quiet=args.quiet,
        argv=sys.argv,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
    )
    print(json.dumps(_sweep_summary(summary)))
    return _failed_units("sweep", summary.failed, summary.n_units, summary.run_dir)


def _failed_units(command: str, failed: list[str], n_units: int, run_dir) -> int:
    """Exit 3 with a one-line summary when any unit of the sweep is an error, else 0."""
    if not failed:
        return EXIT_OK
    print(
        f"ernie5 {command}: error: {len(failed)} of {n_units} units failed (first: {failed[0]}); "
        f"see {Path(run_dir) / 'units.csv'}",
        file=sys.stderr,
    )
    return EXIT_EVAL_FAILED


def _sweep_summary(s) -> dict:
    return {
        "run_dir": str(s.run_dir),
        "units": s.n_units,
        "computed": s.computed,
        "reused": s.reused,
        "skipped": s.skipped,
        "errors": s.errors,
        "unit_wall_s": round(s.wall_s, 3),
        "model_s": round(s.model_s, 3),
        "harness_overhead_share": round(s.overhead_share, 4),
        "cache_hits": s.cache_hits,
        "cache_misses": s.cache_misses,
    }


def cmd_lm_eval(args) -> int:
    """``ernie5 lm-eval``: lm-eval's own command line with the ``ernie5`` model registered."""
    from evals.lm_eval_bridge import run_lm_eval_cli

    return run_lm_eval_cli(args.lm_eval_args)


def cmd_report(args) -> int:
    """``ernie5 report``."""
    from reports import build_report

    if args.out is not None:
        _check_out(args.out)
    elif Path(args.run_dir).is_dir():
        _check_out(Path(args.run_dir) / "report", "report folder")
    out = build_report(args.run_dir, args.out)
    print(out / "index.html")
    return 0


def cmd_compare(args) -> int:
    """``ernie5 compare``: with --fail-on-regression, exit 1 on any significant regression."""
    from reports import compare_runs

    if args.out is not None:
        _check_out(args.out)
    result = compare_runs(args.base_run, args.new_run, args.out)
    print(result.summary_markdown)
    print(f"written to {result.out_dir}", file=sys.stderr)
    return EXIT_REGRESSION if args.fail_on_regression and result.has_regression else 0


def cmd_nightly(args) -> int:
    """``ernie5 nightly``: the main job."""
    from jobs.nightly import run_nightly

    if args.out is not None:
        _check_out(args.out)
    result = run_nightly(
        checkpoint=args.checkpoint,
        suite=args.suite,
        data_dir=args.data_dir,
        out=args.out,
        baseline=getattr(args, "baseline", None),
        quiet=args.quiet,
        confirm_run_unsafe_code=args.confirm_run_unsafe_code,
    )
    return _failed_units("nightly", result["failed_units"], result["units"], result["run_dir"])


# ---------------------------------------------------------------------------- parser
def _device_argument(parser: argparse.ArgumentParser, key: str) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help=f"where to train: auto (a GPU when there is one, else the CPU; the config's default), cpu or "
        f"cuda; the same as --set {key}=...",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argparse tree of every command."""
    epilog = "exit codes:\n" + "\n".join(
        textwrap.fill(what, 100, initial_indent=f"  {code:<4} ", subsequent_indent=" " * 7)
        for code, what in EXIT_CODES.items()
    )
    p = argparse.ArgumentParser(
        prog="ernie5",
        description=__doc__.splitlines()[0],
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    t = sub.add_parser("train", help="pretrain a model (elastic sampling, MTP, aux-free balancing)")
    t.add_argument("--config", required=True, help="preset name (micro, nano) or a run-config YAML file")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    t.add_argument("--out", required=True, help="run folder to create (or continue with --resume)")
    t.add_argument(
        "--resume", action="store_true", help="continue from the run folder's newest complete checkpoint"
    )
    t.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    _device_argument(t, "train.device")
    t.set_defaults(fn=cmd_train)

    for name, fn, what, defaults in (
        ("sft", cmd_sft, "supervised fine-tuning of a checkpoint (loss on answers only)", "the sft preset"),
        ("rl", cmd_rl, "RL from a checkpoint: harness tasks as verifiers, MISC/WPSM/AHRL, U-RB/APRIL/sync",
         "the RL defaults"),
    ):  # fmt: skip
        pt = sub.add_parser(name, help=what)
        pt.add_argument("--checkpoint", required=True, help="checkpoint folder, run folder or `reference`")
        pt.add_argument("--out", required=True, help="run folder to create (or continue with --resume)")
        pt.add_argument("--config", default=None, help=f"YAML file of overrides of {defaults}")
        pt.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)"
        )
        pt.add_argument(
            "--resume", action="store_true", help="continue from the run folder's newest complete checkpoint"
        )
        pt.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
        pt.add_argument("--quiet", action="store_true", help="no progress bar")
        _device_argument(pt, "rl.device" if name == "rl" else "train.device")
        pt.set_defaults(fn=fn)

    rs = sub.add_parser("rl-study", help="an RL ablation (objective, ahrl, scheduler): its arms and report")
    rs.add_argument("study", choices=["objective", "ahrl", "scheduler"])
    rs.add_argument("--checkpoint", required=True, help="checkpoint folder, run folder or `reference`")
    rs.add_argument("--out", required=True, help="study folder (rerun to continue a killed study)")
    rs.add_argument("--config", default=None, help="YAML file of overrides for every arm")
    rs.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every arm (repeatable)")
    rs.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    rs.add_argument("--quiet", action="store_true", help="no progress bar")
    rs.set_defaults(fn=cmd_rl_study)

    st = sub.add_parser("study", help="a study: elastic (elastic vs static, pruned and recovered models)")
    st.add_argument("study", choices=["elastic"])
    st.add_argument("--config", required=True, help="study preset (study_micro, study_small) or YAML file")
    st.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a study value (repeatable)")
    st.add_argument("--out", required=True, help="study folder (rerun to continue a killed study)")
    st.add_argument("--resume", action="store_true", help="continue into a folder that is not yet a study")
    st.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    st.add_argument("--quiet", action="store_true", help="no progress bar")
    st.set_defaults(fn=cmd_study)

    for name, fn, what in (
        (
            "train-vision-tokenizer",
            cmd_train_vision_tokenizer,
            "train the causal multi-scale bitwise vision tokenizer (2D, then inflated to 3D)",
        ),
        ("train-refiner", cmd_train_refiner, "train the cascaded diffusion refiner (2x upsampling)"),
        (
            "train-audio-codec",
            cmd_train_audio_codec,
            "train the RVQ audio codec (level 1 distilled toward a semantic teacher)",
        ),
    ):
        tv = sub.add_parser(name, help=what)
        tv.add_argument("--out", required=True, help="output folder (new)")
        tv.add_argument("--config", default=None, help="YAML run config (default: the built-in defaults)")
        tv.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)"
        )
        what_data = "FSDD" if name == "train-audio-codec" else "MNIST"
        always = "DTMF" if name == "train-audio-codec" else "shapes"
        tv.add_argument(
            "--data-dir", help=f"data root for {what_data} (default: $ERNIE5_DATA_DIR; {always} always)"
        )
        tv.add_argument("--time-budget", type=float, default=None, help="wall-clock cap in seconds")
        if name == "train-refiner":
            tv.add_argument(
                "--tokenizer", help="a 2D vision tokenizer folder whose round trip is a degradation"
            )
        tv.set_defaults(fn=fn)

    rc = sub.add_parser(
        "recipe",
        help="reproduce the shipped reference model from nothing (tokenizer, codec, refiner, backbone)",
    )
    rc.add_argument("name", choices=["reference"], help="the model to reproduce")
    rc.add_argument("--out", required=True, help="recipe folder (re-run with the same one to resume)")
    rc.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR; procedural world always)")
    rc.add_argument(
        "--set",
        action="append",
        metavar="STAGE.KEY=VALUE",
        help="override a stage's config (vision, codec, refiner, backbone), e.g. backbone.train.steps=8",
    )
    rc.add_argument(
        "--install", action="store_true", help="copy the export into the package (ernie5/reference)"
    )
    rc.add_argument("--quiet", action="store_true")
    rc.set_defaults(fn=cmd_recipe)

    pa = sub.add_parser("params", help="total/active params, activation rate and FLOPs per token")
    pa.add_argument("--config", help="preset name or run-config YAML")
    pa.add_argument("--checkpoint", help="checkpoint folder or run folder (its newest checkpoint)")
    pa.add_argument("--subnet", help="elastic sub-model, e.g. d0.75-w0.5-k1")
    pa.add_argument("--set", action="append", metavar="KEY=VALUE", help="override model.* values")
    pa.add_argument(
        "--seq-len", type=int, default=None, help="context for attention FLOPs (default: max_seq_len)"
    )
    pa.add_argument("--json", action="store_true", help="print JSON")
    pa.set_defaults(fn=cmd_params)

    e = sub.add_parser("extract", help="write a standalone checkpoint of a sub-model (physically sliced)")
    e.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    e.add_argument("--subnet", required=True, help="sub-model spec, e.g. d0.75-w0.5-k1")
    e.add_argument("--out", required=True, help="new checkpoint folder")
    e.add_argument("--data-dir", help="data root for importance calibration text (optional)")
    e.set_defaults(fn=cmd_extract)

    g = sub.add_parser("generate", help="generate text from a checkpoint (optionally a sub-model)")
    g.add_argument("--checkpoint", required=True)
    g.add_argument("--subnet", default=None)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (>= 1)")
    g.add_argument("--speculative", action="store_true", help="MTP self-speculative decoding (greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default), > 0 samples")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="benchmarks printing JSON (medians over repeats)")
    b.add_argument("what", choices=["moe", "decode", "train"])
    b.add_argument("--json", action="store_true", help="print JSON only")
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--tokens", type=int, default=2048, help="moe: tokens per forward")
    b.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated per repeat")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    b.add_argument(
        "--decoding",
        choices=["sampled", "greedy"],
        default=None,
        help="decode: sample at temperature 1 with a fixed seed (default) or decode greedily",
    )
    b.add_argument(
        "--peer",
        action="store_true",
        help="train: also time Hugging Face Mixtral at the same shape in this process (needs transformers)",
    )
    b.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        help="train: micro-batches (8 x 256 tokens each) per optimizer step (default 1, as perf-anchors.md)",
    )
    b.add_argument(
        "--activation-checkpoint",
        action="store_true",
        help="train: recompute each block's activations in the backward; reports the saved activation memory",
    )
    b.add_argument(
        "--fp8",
        action="store_true",
        help="train: the blocks' dense projections in FP8 (torchao; a GPU of compute capability >= 8.9)",
    )
    b.set_defaults(fn=cmd_bench)

    ta = sub.add_parser(
        "tasks", help="list the registered evaluation tasks and whether their data is present"
    )
    ta.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    ta.add_argument("--json", action="store_true", help="print JSON")
    ta.set_defaults(fn=cmd_tasks)

    sp = sub.add_parser(
        "specialists",
        help="score the specialist baselines (a small model trained for one task) on a suite's items",
    )
    sp.add_argument("--suite", required=True, help="suite name (nightly, reference, ...) or YAML file")
    sp.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    sp.add_argument("--json", action="store_true", help="print JSON")
    sp.set_defaults(fn=cmd_specialists)

    sw = sub.add_parser("sweep", help="evaluate every (sub-model, task) unit of a suite on a checkpoint")
    sw.add_argument("--checkpoint", required=True, help="checkpoint folder or run folder")
    sw.add_argument("--suite", required=True, help="suite name (smoke, nightly, full) or YAML file")
    sw.add_argument(
        "--out", required=True, help="run folder (units already there with a matching fingerprint are kept)"
    )
    sw.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    sw.add_argument("--limit", type=int, help="cap the examples of every task (>= 1)")
    sw.add_argument(
        "--resume", action="store_true", help="continue a run folder (same as running into it again)"
    )
    sw.add_argument("--cache", help="response cache file (default: RUN_DIR/cache.sqlite)")
    sw.add_argument("--quiet", action="store_true", help="no progress bar")
    sw.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="allow the suite's lm-eval tasks to run Python from their task folder (`!function`)",
    )
    sw.set_defaults(fn=cmd_sweep)

    le = sub.add_parser(
        "lm-eval",
        add_help=False,
        help="run any lm-eval task on a sub-model: ernie5 lm-eval --model ernie5 --model_args "
        "checkpoint=CKPT,subnet=k1 --tasks T [--include_path DIR] [--output_path OUT] (lm-eval's arguments)",
    )
    le.add_argument("lm_eval_args", nargs=argparse.REMAINDER)
    le.set_defaults(fn=cmd_lm_eval)

    r = sub.add_parser("report", help="HTML report, Markdown summary and CSV/JSON tables of a sweep run")
    r.add_argument("run_dir", metavar="RUN_DIR", help="sweep run folder (manifest.json, units/, ...)")
    r.add_argument("--out", default=None, help="report folder (default: RUN_DIR/report)")
    r.set_defaults(fn=cmd_report)

    c = sub.add_parser("compare", help="paired per-(subnet, task) comparison of two sweep runs")
    c.add_argument("base_run", metavar="BASE_RUN", help="baseline run folder (e.g. last night's)")
    c.add_argument("new_run", metavar="NEW_RUN", help="run folder under test")
    c.add_argument("--out", default=None, help="output folder (default: NEW_RUN/report/compare-<BASE name>)")
    c.add_argument(
        "--fail-on-regression", action="store_true", help="exit 1 on any significant regression (CI gate)"
    )
    c.set_defaults(fn=cmd_compare)

    n = sub.add_parser(
        "nightly", help="the main job: sweep the shipped reference (or a checkpoint) over the nightly suite"
    )
    n.add_argument("--checkpoint", help="evaluate this checkpoint (default: the shipped reference)")
    n.add_argument("--suite", default="nightly", help="suite name or YAML file")
    n.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    n.add_argument("--out", default=None, help="run folder (default: runs/nightly-<date>)")
    n.add_argument("--baseline", help="an earlier run folder to compare against")
    n.add_argument("--quiet", action="store_true")
    n.add_argument(
        "--confirm-run-unsafe-code",
        action="store_true",
        help="allow the suite's lm-eval tasks to run Python from their task folder (`!function`)",
    )
    n.set_defaults(fn=cmd_nightly)
    return p


def main(argv: list[str] | None = None) -> int:
    """Console entry point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from ernie5.kernels import mode as kernels_mode
    from ernie5.runtime.allocator import tune_allocator

    tune_allocator()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        kernels_mode()
    except ValueError as e:
        print(f"ernie5: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv[:1] == ["lm-eval"]:  # forward verbatim: argparse's REMAINDER rejects a leading --option
        args = argparse.Namespace(command="lm-eval", fn=cmd_lm_eval, lm_eval_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        if hasattr(args, "data_dir"):
            from ernie5.data.root import resolve_data_dir

            resolve_data_dir(args.data_dir)  # a root that is not a folder is bad input, before any work
        return args.fn(args)
    except _user_errors() as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"ernie5 {args.command}: error: {msg}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"ernie5 {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`ernie5 params --json | head`): stop quietly, as Unix tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as e:
        if e.filename is None:  # not about a file or folder: a real failure, keep its traceback
            raise
        print(f"ernie5 {args.command}: error: {_os_error_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
