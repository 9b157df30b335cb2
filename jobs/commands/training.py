"""Training commands: ``train``, ``sft``, ``rl``, ``rl-study``, ``study``, the side trainers, ``recipe``.

Each handler sits beside the parser of its command; :func:`add_parsers` adds them to ``ernie5``.
"""

from __future__ import annotations

import json
import os
import sys

from jobs.commands.common import (
    CLIError,
    check_out,
    device_argument,
    load_run_config,
    log_with_argument,
    print_json,
    with_device,
)


def cmd_train(args) -> int:
    """``ernie5 train``."""
    from train.pretrain.loop import pretrain

    check_out(args.out)
    cfg = load_run_config(args.config, with_strict(args, with_device(args, "train.device")))
    last = pretrain(
        cfg,
        args.out,
        resume=args.resume,
        data_dir=args.data_dir,
        quiet=args.quiet,
        log_with=args.log_with or (),
    )
    if last and int(os.environ.get("RANK", "0")) == 0:  # one summary for a multi-process run
        print(json.dumps({k: last[k] for k in ("step", "loss", "tokens_per_s", "mfu") if k in last}))
    skipped_sources("train", args.out)
    return 0


def add_train_parser(sub) -> None:
    """``ernie5 train``."""
    t = sub.add_parser("train", help="pretrain a model (elastic sampling, MTP, aux-free balancing)")
    t.add_argument("--config", required=True, help="preset name (micro, nano) or a run-config YAML file")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)")
    t.add_argument("--out", required=True, help="run folder to create (or continue with --resume)")
    t.add_argument(
        "--resume", action="store_true", help="continue from the run folder's newest complete checkpoint"
    )
    t.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.add_argument("--strict", action="store_true", help="a data source without data is an error (exit 2)")
    device_argument(t, "train.device")
    log_with_argument(t)
    t.set_defaults(fn=cmd_train)


def _verifiers(cfg, data_dir):
    import evals.tasks  # noqa: F401  (registers the tasks)
    from evals.verifiers import TaskVerifier

    return {name: TaskVerifier(name, data_dir) for name in cfg.tasks}


def cmd_sft(args) -> int:
    """``ernie5 sft``: supervised fine-tuning of a checkpoint on instruction turns."""
    from train.pretrain.sft import sft

    check_out(args.out)
    last = sft(
        args.checkpoint,
        args.out,
        config=args.config,
        overrides=with_strict(args, with_device(args, "train.device")),
        resume=args.resume,
        data_dir=args.data_dir,
        quiet=args.quiet,
        log_with=args.log_with or (),
    )
    if last:
        print(json.dumps({k: last[k] for k in ("step", "loss", "tokens_per_s", "mfu") if k in last}))
    skipped_sources("sft", args.out)
    return 0


def with_strict(args, overrides: list[str]) -> list[str]:
    """``--strict`` as ``data.strict=true`` (winning over a ``--set`` of it)."""
    return [*overrides, "data.strict=true"] if getattr(args, "strict", False) else overrides


def skipped_sources(command: str, out) -> None:
    """Name on stderr every data source the run skipped, with how to supply it (from its meta.json)."""
    from pathlib import Path

    meta = Path(out) / "meta.json"
    if int(os.environ.get("RANK", "0")) != 0 or not meta.is_file():
        return
    skipped = json.loads(meta.read_text()).get("data_sources_skipped") or {}
    if skipped:
        print(f"ernie5 {command}: trained without {len(skipped)} data source(s):", file=sys.stderr)
        for name, why in sorted(skipped.items()):
            print(f"  {name}: {why}", file=sys.stderr)


def cmd_rl(args) -> int:
    """``ernie5 rl``: reinforcement learning from a checkpoint with the harness's tasks as verifiers."""
    from ernie5.data.root import resolve_data_dir
    from train.rl.trainer import rl, rl_config

    check_out(args.out)
    cfg = rl_config(args.checkpoint, args.config, with_device(args, "rl.device"))
    data_dir = resolve_data_dir(args.data_dir or cfg.data_dir or None)
    verifiers = _verifiers(cfg, data_dir)
    last = rl(cfg, args.out, verifiers, resume=args.resume, quiet=args.quiet, log_with=args.log_with or ())
    if last:
        keys = ("step", "reward", "entropy", "response_len", "idle_s")
        print(json.dumps({k: last[k] for k in keys if k in last}))
    return 0


def add_sft_rl_parser(sub) -> None:
    """``ernie5 sft`` and ``ernie5 rl``."""
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
        if name == "sft":
            pt.add_argument(
                "--strict", action="store_true", help="a data source without data is an error (exit 2)"
            )
        device_argument(pt, "rl.device" if name == "rl" else "train.device")
        log_with_argument(pt)
        pt.set_defaults(fn=fn)


def cmd_rl_study(args) -> int:
    """``ernie5 rl-study``: one RL ablation (its arms as RL runs) and its report section."""
    from ernie5.data.root import resolve_data_dir
    from jobs.rl_study import run_study

    check_out(args.out)
    data_dir = resolve_data_dir(args.data_dir)
    path = run_study(
        args.study,
        args.checkpoint,
        args.out,
        lambda cfg: _verifiers(cfg, data_dir),
        overrides=args.set or [],
        config=args.config,
        seeds=args.seeds,
        quiet=args.quiet,
        data_dir=data_dir,
        heldout_limit=args.heldout_limit,
    )
    print(json.dumps({"report": str(path)}))
    return 0


def add_rl_study_parser(sub) -> None:
    """``ernie5 rl-study``."""
    rs = sub.add_parser("rl-study", help="an RL ablation (objective, ahrl, scheduler): its arms and report")
    rs.add_argument("study", choices=["objective", "ahrl", "scheduler"])
    rs.add_argument("--checkpoint", required=True, help="checkpoint folder, run folder or `reference`")
    rs.add_argument("--out", required=True, help="study folder (rerun to continue a killed study)")
    rs.add_argument("--config", default=None, help="YAML file of overrides for every arm")
    rs.add_argument("--set", action="append", metavar="KEY=VALUE", help="override for every arm (repeatable)")
    rs.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    rs.add_argument(
        "--seeds", type=int, default=3, help="runs per arm, rl.seed and up (default 3; each figure gets a CI)"
    )
    rs.add_argument(
        "--heldout-limit",
        type=int,
        default=200,
        help="items per task of the harness sweep of each run's last checkpoint (default 200; 0: none)",
    )
    rs.add_argument("--quiet", action="store_true", help="no progress bar")
    rs.set_defaults(fn=cmd_rl_study)


def cmd_study(args) -> int:
    """``ernie5 study elastic``: the elastic-training study (its models, sweeps and report)."""
    from jobs.elastic_study import load_study_config, run_study

    check_out(args.out)
    cfg = load_study_config(args.config, args.set or [])
    path = run_study(
        cfg, args.out, data_dir=args.data_dir, resume=args.resume, quiet=args.quiet, argv=sys.argv
    )
    print(json.dumps({"report": str(path)}))
    return 0


def add_study_parser(sub) -> None:
    """``ernie5 study``."""
    st = sub.add_parser("study", help="a study: elastic (elastic vs static, pruned and recovered models)")
    st.add_argument("study", choices=["elastic"])
    st.add_argument("--config", required=True, help="study preset (study_micro, study_small) or YAML file")
    st.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a study value (repeatable)")
    st.add_argument("--out", required=True, help="study folder (rerun to continue a killed study)")
    st.add_argument("--resume", action="store_true", help="continue into a folder that is not yet a study")
    st.add_argument("--data-dir", help="data root (default: $ERNIE5_DATA_DIR)")
    st.add_argument("--quiet", action="store_true", help="no progress bar")
    st.set_defaults(fn=cmd_study)


def _train_component(args, config_cls, train_fn, **kwargs) -> int:
    """Shared body of the ``train-*`` commands: a new --out folder (or one a stopped run left with its
    resume state, which the run continues from), a strict config, a JSON summary."""
    from ernie5.config import load
    from train.side.resume import RESUME_FILE

    out = check_out(args.out)
    if out.exists() and any(out.iterdir()) and not (out / RESUME_FILE).is_file():
        raise CLIError(f"--out {out} already exists and is not empty; choose a new folder")
    cfg = load(config_cls, args.config, args.set or [])
    print_json(train_fn(cfg, out, args.data_dir, time_budget_s=args.time_budget, **kwargs))
    return 0


def cmd_train_vision_tokenizer(args) -> int:
    """``ernie5 train-vision-tokenizer``."""
    from train.side.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer

    return _train_component(args, VisionTokenizerTrainConfig, train_vision_tokenizer)


def cmd_train_audio_codec(args) -> int:
    """``ernie5 train-audio-codec``."""
    from train.side.audio_codec import AudioCodecTrainConfig, train_audio_codec

    return _train_component(args, AudioCodecTrainConfig, train_audio_codec)


def cmd_train_speech_encoder(args) -> int:
    """``ernie5 train-speech-encoder``."""
    from train.side.speech_content import SpeechContentTrainConfig, train_speech_content

    return _train_component(args, SpeechContentTrainConfig, train_speech_content)


def cmd_train_refiner(args) -> int:
    """``ernie5 train-refiner``."""
    from train.side.refiner import RefinerTrainConfig, train_refiner

    return _train_component(args, RefinerTrainConfig, train_refiner, tokenizer_path=args.tokenizer)


def add_side_parser(sub) -> None:
    """``ernie5 train-vision-tokenizer`` / ``train-audio-codec`` / ``train-speech-encoder`` /
    ``train-refiner``."""
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
        (
            "train-speech-encoder",
            cmd_train_speech_encoder,
            "train the speech-content encoder (CTC over many voices) whose features understanding reads",
        ),
    ):
        tv = sub.add_parser(name, help=what)
        tv.add_argument("--out", required=True, help="output folder (new)")
        tv.add_argument("--config", default=None, help="YAML run config (default: the built-in defaults)")
        tv.add_argument(
            "--set", action="append", metavar="KEY=VALUE", help="override a config value (repeatable)"
        )
        audio = name in ("train-audio-codec", "train-speech-encoder")
        what_data = "FSDD" if audio else "MNIST"
        always = {"train-audio-codec": "DTMF", "train-speech-encoder": "eSpeak NG voices"}.get(name, "shapes")
        tv.add_argument(
            "--data-dir", help=f"data root for {what_data} (default: $ERNIE5_DATA_DIR; {always} always)"
        )
        tv.add_argument("--time-budget", type=float, default=None, help="wall-clock cap in seconds")
        if name == "train-refiner":
            tv.add_argument(
                "--tokenizer", help="a 2D vision tokenizer folder whose round trip is a degradation"
            )
        tv.set_defaults(fn=fn)


def cmd_recipe(args) -> int:
    """``ernie5 recipe reference``: reproduce (or resume) the shipped reference model."""
    from jobs.recipe import run_recipe

    check_out(args.out)
    record = run_recipe(
        args.out,
        args.data_dir,
        overrides=args.set or [],
        install=args.install,
        quiet=args.quiet,
        device=args.device,
    )
    print_json({"out": args.out, "stages": record["stages"], "inputs_digest": record["inputs_digest"]})
    return 0


def add_recipe_parser(sub) -> None:
    """``ernie5 recipe``."""
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
        help="override a stage's config (vision, codec, backbone, anneal, continue, refiner), "
        "e.g. backbone.train.steps=8",
    )
    rc.add_argument(
        "--install", action="store_true", help="copy the export into the package (ernie5/reference)"
    )
    rc.add_argument("--quiet", action="store_true")
    rc.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        help="where the backbone, its anneals and its continuation train (train.device; default: the "
        "preset's auto); the side models train on the CPU",
    )
    rc.set_defaults(fn=cmd_recipe)


def add_parsers(sub) -> None:
    """This module's commands, in ``ernie5 --help`` order."""
    add_train_parser(sub)
    add_sft_rl_parser(sub)
    add_rl_study_parser(sub)
    add_study_parser(sub)
    add_side_parser(sub)
    add_recipe_parser(sub)
