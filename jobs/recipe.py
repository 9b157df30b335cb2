"""``ernie5 recipe reference``: reproduce the shipped reference model from nothing.

One command, unattended, seeded, in these stages under ``--out DIR``:

    DIR/vision/     the vision tokenizer (2D, then 3D; ``ernie5 train-vision-tokenizer``)
    DIR/speech/     the speech-content encoder (CTC transcription over FSDD's training voices, eSpeak NG
                    voices and LJSpeech; :mod:`train.side.speech_content`), whose features the backbone
                    reads beside the codes of understanding frames (``model.audio.content_dim``)
    DIR/codec/      the RVQ audio codec (``ernie5 train-audio-codec``)
    DIR/backbone/   the elastic backbone (``ernie5 train --config reference``), frozen tokenizer and
                    codec from the stages above
    DIR/anneal/     the backbone's anneal, twice (``a/``, ``b/``): its last checkpoint trained on at
                    a lower learning rate decaying to almost zero, on new batches, with the clean FSDD
                    and shapes sources weighted up by two amounts (:data:`ANNEAL_OVERRIDES`,
                    :data:`ANNEAL_MIXES`)
    DIR/soup1/      their uniform soup, exported as the reference is (bf16 parameters): the second
                    reference (v2) was this folder
    DIR/continue/   the soup continued (:data:`CONTINUE_OVERRIDES`): 6000 more steps with a fresh
                    optimizer, new batches and a second warmup-stable-decay cycle at half the peak
                    learning rate
    DIR/anneal2/    the continuation's anneal, twice (``a/``, ``b/``), as the first round
    DIR/refiner/    the cascaded refiner on the 2D tokenizer's round trips (``ernie5 train-refiner``)
    DIR/reference/  the export: the uniform soup (weight mean, :mod:`train.common.soup`) of the second
                    round's anneals with the tokenizer, codec and refiner, parameters in bf16, no
                    optimizer state (the folder the package ships)
    DIR/recipe.json what was run: every stage's config and wall time, and the sha256 of every input
                    file read from the data root

Resuming: the command is re-run with the same ``--out``. A finished stage is kept (each side model
is trained into a temporary folder renamed into place when complete); a side model's stage continues
from its resume state (every ``resume.every`` steps, and at once on ``SIGTERM``: :mod:`train.side.resume`),
the backbone and its anneals from their newest checkpoint (every ``train.ckpt_every`` steps, and on
``SIGTERM``), all with exact resume, so ``kill -9`` costs at most one checkpoint interval and a
preemption nothing. ``SIGTERM`` (or a first Ctrl-C) during any stage stops it at its next step boundary
with its state written, and ``ernie5`` exits 143.

Installing: ``--install`` copies the export into the package (``ernie5/reference/``), where
``--checkpoint reference`` finds it; the maintainer commits it with ``MODEL_CARD.md``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ernie5.config import ConfigError, dump, load
from ernie5.data.root import resolve_data_dir
from ernie5.files import file_sha256
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dir
from ernie5.store.runs import provenance, write_json
from train.side.resume import RESUME_FILE

VISION_OVERRIDES: list[str] = []
"""The vision tokenizer's recipe: the trainer's defaults (2000 2D steps, 80 3D steps)."""
SPEECH_OVERRIDES: list[str] = []
"""The speech-content encoder's recipe: the trainer's defaults (4000 CTC steps of 16 utterances)."""
CODEC_OVERRIDES = ["steps=3000"]
"""The codec's recipe: 3000 steps (DTMF round trips need about this many; FSDD with a data root). Its
level 1 stays taught by MFCC k-means: a codec taught by the speech stage's content units instead
(``codec.teacher=content_kmeans``, eSpeak NG crops, half the speech crops augmented) was measured in
the v4 sitting and gave no better codes for understanding (a classifier on level 1 names an unseen
speaker's digit 0.354 of the time, against 0.350) and worse round trips (DTMF exact 0.13 against 0.34,
FSDD mel distance 1.41 against 1.23)."""
REFINER_OVERRIDES = ["steps=400"]
"""The refiner's recipe: 400 steps on shapes and MNIST degraded by the 2D tokenizer and blur (it only
upsamples generated images; the backbone does not depend on it, so it trains after the backbone)."""
CONTINUE_OVERRIDES = ["train.steps=6000", "train.seed=2", "optim.lr=0.0005"]
"""The continuation's recipe, over the backbone's preset (its WSD schedule, warmup and decay): 6000 more
steps from the first soup, a fresh optimizer, new batches from seed 2, peak learning rate 5e-4. The
backbone was still learning at 8000 steps, the video tasks most of all (MODEL_CARD.md: the same
continuation from the backbone's last checkpoint took ``video_digits`` from 0.710 to 0.925)."""
ANNEAL_OVERRIDES = [
    "train.steps=1500",
    "train.seed=1",
    "train.ckpt_every=500",
    "optim.lr=0.0003",
    "schedule.warmup_steps=30",
    "schedule.decay_frac=1.0",
    "schedule.min_lr_ratio=0.03",
]
"""The anneal's recipe, over the backbone's preset: 1500 more steps (a fresh optimizer, new batches
from seed 1), the learning rate warming to 3e-4 and decaying linearly to 1e-5."""
ANNEAL_MIXES = {
    "a": ["data.sources.fsdd=0.16", "data.sources.shapes=0.08"],
    "b": ["data.sources.fsdd=0.20", "data.sources.shapes=0.12"],
}
"""The two anneals' data mixes: the clean seen-speaker FSDD and fixed-size shapes sources (they carry
ASR on seen voices and the shapes ``t2i_shapes`` asks for) weighted up from the preset's 0.10 / 0.05.
Measured on the reference suite (MODEL_CARD.md): the backbone alone has ``video_shapes`` 0.805,
``video_digits`` 0.595, unseen-speaker ``spoken_digit_qa`` 0.465; anneal ``a`` 0.875 / 0.690 / 0.495;
``b`` 0.830 / 0.730 / 0.560; their soup 0.860 / 0.710 / 0.515, with the lowest seen-speaker WER of the
four (0.057, against 0.082 / 0.066 / 0.064) and every text task at or near the better branch's level."""
PRESET = "reference"
STAGES = ("vision", "speech", "codec", "backbone", "anneal", "continue", "refiner")
"""The trained stages, in order (the export follows); ``anneal`` names both rounds of anneals."""

DATA_FOLDERS = (
    "mnist",
    "fsdd",
    "ljspeech_mini",
    "tinyshakespeare",
    "babi_qa1",
    "gsm8k",
    "svamp",
    "arc",
    "openbookqa",
)
"""The data-root folders the recipe's stages may read (their files are hashed into recipe.json)."""


def split_overrides(overrides: list[str]) -> dict[str, list[str]]:
    """``["backbone.train.steps=8", ...]`` -> ``{"backbone": ["train.steps=8"], "vision": [], ...}``."""
    out: dict[str, list[str]] = {name: [] for name in STAGES}
    for item in overrides:
        stage, _, rest = item.partition(".")
        if stage not in out or "=" not in rest:
            raise ConfigError(
                f"--set {item!r}: expected STAGE.KEY=VALUE with STAGE one of {', '.join(STAGES)}"
            )
        out[stage].append(rest)
    return out


def hash_inputs(data_dir: Path | None) -> dict[str, Any]:
    """sha256 of every file under the data-root folders the recipe reads, per folder: its file
    count, one digest over the sorted ``(path, sha256)`` pairs, and every file's own digest."""
    if data_dir is None:
        return {}
    out: dict[str, Any] = {}
    for name in DATA_FOLDERS:
        folder = Path(data_dir) / name
        if not folder.is_dir():
            continue
        files = {
            str(p.relative_to(data_dir)): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()
        }
        digest = hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in files.items()).encode()).hexdigest()
        out[name] = {"n_files": len(files), "sha256": digest, "files": files}
    return out


def _stage(
    out: Path, done: Callable[[Path], bool], train: Callable[[Path], Any], what: str, quiet: bool
) -> bool:
    """Train ``what`` into a temporary sibling of ``out`` and rename it into place; skip a complete
    ``out``. Returns whether it trained."""
    if out.is_dir() and done(out):
        if not quiet:
            print(f"recipe: {what}: done ({out})", file=sys.stderr)
        return False
    if out.exists():  # an incomplete stage from a killed run: redo it
        shutil.rmtree(out)
    tmp = out.with_name(f".{out.name}.tmp")
    if not (tmp / RESUME_FILE).is_file():  # else a stopped side trainer continues from its state
        shutil.rmtree(tmp, ignore_errors=True)
    if not quiet:
        print(f"recipe: training the {what} into {out}", file=sys.stderr)
    train(tmp)
    tmp.rename(out)
    return True


def export_reference(
    run_dirs: Sequence[Path], out: Path, refiner_dir: Path | None, recipe: dict[str, Any]
) -> Path:
    """The shipped folder: the uniform soup of the runs' newest checkpoints (one run: that checkpoint),
    parameters cast to bf16 (buffers such as the router bias stay fp32), the refiner attached, no
    optimizer state; ``meta.json`` records the recipe, the soup's ingredients and ``load_dtype:
    float32`` (loading upcasts, so evaluation computes as for any checkpoint). The side models are the
    first run's (every run is given the same ones)."""
    from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
    from ernie5.tokenizers.refiner import Refiner
    from train.common.soup import uniform_soup

    if not run_dirs:
        raise ConfigError("export_reference: expected at least one run folder, got none")
    ckpt = load_checkpoint(run_dirs[0], fast=False)
    ingredients = [ckpt.path]
    if len(run_dirs) > 1:
        states = [ckpt.model.state_dict()]
        for run_dir in run_dirs[1:]:
            other = load_checkpoint(run_dir, fast=False)
            states.append(other.model.state_dict())
            ingredients.append(other.path)
        ckpt.model.load_state_dict(uniform_soup(states))
    with torch.no_grad():  # the side models stay fp32: small, and their quantisers are rounding-sensitive
        for p in ckpt.model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(torch.bfloat16)
    refiner = Refiner.load(refiner_dir) if refiner_dir is not None else ckpt.refiner
    meta = {
        "reference": {
            "source_checkpoints": [str(p) for p in ingredients],
            "step": ckpt.meta.get("step"),
            "recipe": recipe,
        },
        "load_dtype": "float32",
        "weights_dtype": "bfloat16",
    }
    return save_checkpoint(
        out,
        ckpt.model,
        tokenizer=ckpt.tokenizer,
        meta=meta,
        vision_tokenizer=ckpt.vision_tokenizer,
        refiner=refiner,
        audio_codec=ckpt.audio_codec,
    )


def run_recipe(
    out: str | Path,
    data_dir: str | Path | None = None,
    *,
    overrides: list[str] | None = None,
    install: bool = False,
    quiet: bool = False,
    device: str | None = None,
) -> dict[str, Any]:
    """Run (or resume) the reference recipe into ``out``; returns ``recipe.json``'s content.

    ``device`` (``auto``, ``cpu``, ``cuda``; None: the preset's ``auto``) is where the backbone, its
    anneals and its continuation train (``train.device``; a resumed stage may move). The side models
    (vision tokenizer, speech encoder, codec, refiner: small convolutional nets) train on the CPU.

    ``overrides`` are ``STAGE.KEY=VALUE`` strings (``STAGE``: one of :data:`STAGES`) added to that
    stage's config after the recipe's own, e.g. ``backbone.train.steps=8`` for a smoke run; a
    resumed recipe must be given the same ones (the stages' configs are compared).
    """
    from train.pretrain.config import RunConfig
    from train.side.audio_codec import AudioCodecTrainConfig, train_audio_codec
    from train.side.refiner import RefinerTrainConfig, train_refiner
    from train.side.speech_content import SpeechContentTrainConfig, train_speech_content
    from train.side.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer

    extra = split_overrides(overrides or [])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir = resolve_data_dir(data_dir)
    record_path = out / "recipe.json"
    record: dict[str, Any] = json.loads(record_path.read_text()) if record_path.is_file() else {}
    inputs = hash_inputs(data_dir)
    if record.get("inputs_digest") and record["inputs_digest"] != _digest(inputs):
        raise ConfigError(
            f"{record_path}: the data root's files differ from the ones this recipe started with "
            "(resume with the same data root, or start a new --out)"
        )
    record.setdefault("provenance", provenance(seed=0))
    record["data_dir"] = str(data_dir) if data_dir else None
    record["inputs_digest"] = _digest(inputs)
    stages: dict[str, Any] = record.setdefault("stages", {})

    def timed(name: str, cfg_text: str, fn: Callable[[], bool]) -> None:
        t0 = time.perf_counter()
        trained = fn()
        entry = stages.setdefault(name, {})
        entry["config"] = cfg_text
        if trained:
            entry["seconds"] = round(time.perf_counter() - t0, 1)  # of the invocation that finished it
        write_json(record_path, record)

    for name, text in (record.get("overrides") or {}).items():
        if text != extra.get(name, []):
            raise ConfigError(
                f"{record_path}: started with {name} overrides {text}, now {extra.get(name, [])}"
            )
    record["overrides"] = extra
    vcfg = load(VisionTokenizerTrainConfig, None, VISION_OVERRIDES + extra["vision"])
    timed(
        "vision",
        dump(vcfg),
        lambda: _stage(
            out / "vision",
            lambda d: (
                (d / "tokenizer_3d" / "meta.json").is_file() and (d / "tokenizer_2d" / "meta.json").is_file()
            ),
            lambda tmp: train_vision_tokenizer(vcfg, tmp, data_dir),
            "vision tokenizer",
            quiet,
        ),
    )
    scfg = load(SpeechContentTrainConfig, None, SPEECH_OVERRIDES + extra["speech"])
    timed(
        "speech",
        dump(scfg),
        lambda: _stage(
            out / "speech",
            lambda d: (d / "encoder" / "meta.json").is_file(),
            lambda tmp: train_speech_content(scfg, tmp, data_dir),
            "speech-content encoder",
            quiet,
        ),
    )
    ccfg = load(AudioCodecTrainConfig, None, CODEC_OVERRIDES + extra["codec"])
    timed(
        "codec",
        dump(ccfg),
        lambda: _stage(
            out / "codec",
            lambda d: (d / "codec" / "meta.json").is_file(),
            lambda tmp: train_audio_codec(ccfg, tmp, data_dir),
            "audio codec",
            quiet,
        ),
    )
    backbone_sets = [  # the backbone and its anneals read the stages above, frozen
        f"data.vision_tokenizer={out / 'vision' / 'tokenizer_3d'}",
        f"data.audio_codec={out / 'codec' / 'codec'}",
        f"data.speech_encoder={out / 'speech' / 'encoder'}",
    ]
    # Not recorded as an override: a stage may resume on another device (train.pretrain's may_change).
    backbone_sets += [f"train.device={device}"] if device is not None else []
    bcfg = load(RunConfig, resolve_config_path(PRESET), [*backbone_sets, *extra["backbone"]])
    backbone = out / "backbone"
    timed("backbone", dump(bcfg), lambda: _train_run(bcfg, backbone, data_dir, quiet))

    def anneal_round(start: Path, folder: Path, name: str) -> list[Path]:
        """Both anneals of one round from the checkpoint ``start``, into ``folder/a`` and ``folder/b``."""
        runs = []
        for mix, mix_overrides in ANNEAL_MIXES.items():
            acfg = load(
                RunConfig,
                resolve_config_path(PRESET),
                [
                    *backbone_sets,
                    f"train.init_from={start}",
                    *ANNEAL_OVERRIDES,
                    *mix_overrides,
                    *extra["anneal"],
                ],
            )
            runs.append(folder / mix)
            timed(f"{name}_{mix}", dump(acfg), lambda c=acfg, d=runs[-1]: _train_run(c, d, data_dir, quiet))
        return runs

    first = anneal_round(checkpoint_dir(backbone, bcfg.train.steps), out / "anneal", "anneal")
    soup1 = out / "soup1"
    timed(
        "soup1",
        "",
        lambda: _stage(
            soup1,
            lambda d: (d / "meta.json").is_file(),
            lambda tmp: export_reference(first, tmp, None, {"preset": PRESET, "stage": "soup1"}),
            "first soup",
            quiet,
        ),
    )
    cont_cfg = load(
        RunConfig,
        resolve_config_path(PRESET),
        [*backbone_sets, f"train.init_from={soup1}", *CONTINUE_OVERRIDES, *extra["continue"]],
    )
    continued = out / "continue"
    timed("continue", dump(cont_cfg), lambda: _train_run(cont_cfg, continued, data_dir, quiet))
    anneals = anneal_round(checkpoint_dir(continued, cont_cfg.train.steps), out / "anneal2", "anneal2")
    rcfg = load(RefinerTrainConfig, None, REFINER_OVERRIDES + extra["refiner"])
    timed(
        "refiner",
        dump(rcfg),
        lambda: _stage(
            out / "refiner",
            lambda d: (d / "refiner" / "meta.json").is_file(),
            lambda tmp: train_refiner(rcfg, tmp, data_dir, tokenizer_path=out / "vision" / "tokenizer_2d"),
            "refiner",
            quiet,
        ),
    )
    recipe = {
        "command": "ernie5 recipe reference --out DIR --data-dir DATA",
        "preset": PRESET,
        "stages": {k: {"seconds": v.get("seconds")} for k, v in stages.items()},
        "inputs": {k: {"n_files": v["n_files"], "sha256": v["sha256"]} for k, v in inputs.items()},
        "inputs_digest": record["inputs_digest"],
    }
    t0 = time.perf_counter()
    export_reference(anneals, out / "reference", out / "refiner" / "refiner", recipe)
    stages["export"] = {"seconds": round(time.perf_counter() - t0, 1)}
    record["inputs"] = inputs
    write_json(record_path, record)
    if install:
        install_reference(out / "reference")
    return record


def _train_run(cfg: Any, run_dir: Path, data_dir: Path | None, quiet: bool) -> bool:
    """Train (or resume) one backbone run to ``cfg.train.steps``; False when it had already finished."""
    from ernie5.store.checkpoint import checkpoint_dirs
    from train.pretrain.loop import pretrain

    if checkpoint_dir(run_dir, cfg.train.steps) in checkpoint_dirs(run_dir):
        return False
    pretrain(cfg, run_dir, resume=(run_dir / "config.yaml").is_file(), data_dir=data_dir, quiet=quiet)
    return True


def _digest(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(
        json.dumps({k: v["sha256"] for k, v in inputs.items()}, sort_keys=True).encode()
    ).hexdigest()


def install_reference(folder: Path) -> Path:
    """Copy an exported reference into the package (``ernie5/reference/``), replacing the old one."""
    from ernie5.files import publish_folder
    from ernie5.store.shipped import shipped_dir

    dest = shipped_dir("reference")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(folder, tmp)
    publish_folder(tmp, dest)
    return dest
