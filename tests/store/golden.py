"""Golden forward: a compact fingerprint of what a checkpoint's model computes, for CI.

The shipped ``reference`` checkpoint is only worth shipping while the code computes with its weights
what they were trained to compute. A change to the model's maths (a RoPE theta, a norm epsilon, the
order of a residual, a router detail) can leave every unit test green and silently change what the
shipped weights do. :func:`golden_forward` runs the model on fixed inputs of every modality and
records a small, tolerance-checkable summary; ``tests/store/test_reference.py`` compares it with the
summary stored in ``tests/store/golden_reference.json``, and a mismatch means: retrain or convert the
reference (``ernie5 recipe reference --out DIR --install``), then regenerate the golden file.

Cases (:data:`CASES`), each one packed document laid out by the project's own builders, exactly as
``train/pretrain/data.py`` and ``evals/adapter.py`` lay them out:

  * ``text``, ``text@k1``, ``text@d0.75-w0.5-k2``: a fixed prompt, on the full model and on two
    elastic sub-models (resolved by ``ernie5.subnets.spec.resolve_specs``);
  * ``image_und``: ``BOS BOI <image> EOI`` + a question about a seeded shapes scene;
  * ``image_gen``: ``BOS <prompt> BOI <NFSP positions> EOI EOS``, teacher-forced (bit logits);
  * ``clip_und``: ``BOS BOV <clip> EOV`` + a question about a seeded moving-shape clip;
  * ``audio_und``: ``BOS BOA <frames> EOA`` + the transcript of a seeded DTMF utterance;
  * ``audio_gen``: ``BOS <Dial: ...> BOA <start> <frames> EOA EOS`` with NCP targets (codec logits).

Every input comes from the procedural worlds (``ernie5.data.shapes``, ``ernie5.data.moving``,
``ernie5.data.dtmf``) with fixed seeds: nothing reads the data root or the clock.

Summary of each output (a ``(N, V)`` logits matrix; text logits for every case, plus the bit logits
or each NCP level's logits for the generation cases): the first :data:`N_VALUES` logits at three
fixed rows (first, middle, last), the argmax and the top-1/top-2 margin at those rows, and the mean
and standard deviation of the whole matrix, rounded to 5 decimals.

Tolerances. The golden file is written and checked with the fast paths (``load_checkpoint``'s
default, ``fast=True``); CPUs still differ in their kernels (AMD AVX-512 vs Intel AMX matmuls, the
reduction order of fused kernels), so values are compared with ``|a - e| <= atol + rtol * |e|``.
Measured on the micro multimodal model of ``tests/store/test_golden.py`` (bf16 weights computed in
fp32, logits std ~0.16), fast and eager forwards differ by at most 1e-5 in any recorded value (one
unit of the 5th decimal, i.e. the rounding; see :func:`max_difference`). :data:`RTOL` =
:data:`ATOL` = 2.5e-4 leaves a factor of 25 of headroom for other machines' kernels, while real
maths changes move the recorded values far more on the same model: scaling one attention output
projection by 1.01 moves them by 1.2e-3, the final norm's weight by 1.01 by 4e-3, halving the RoPE
frequencies (a changed ``rope_theta``) by 6.5e-2 (260 x the tolerance). The tests demonstrate a
scaled vision head and a doubled ``rope_theta``. An argmax is compared only where the expected
top-1/top-2 margin exceeds the tolerance (a near-tie may flip legitimately). Discrete side-model
outputs (vision bits, codec codes) are computed in fp32 before the backbone; a code flipping on
another machine would show up as a mismatch of its case, which is then worth a look, not a retrain.

Usage::

    python -m tests.store.golden --checkpoint reference --write tests/store/golden_reference.json
    python -m tests.store.golden --checkpoint reference --check tests/store/golden_reference.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ernie5.data import shapes
from ernie5.data.audio_sources import dial_prompt, transcript_text
from ernie5.data.dtmf import dtmf_utterance
from ernie5.data.moving import DIRECTIONS, moving_shape_clip
from ernie5.data.vision_sources import CLIP_FRAMES, MOTION_QUESTION, qa_text
from ernie5.model.inputs import Inputs
from ernie5.model.model import ModelOutput
from ernie5.sequence import audio as audio_docs
from ernie5.sequence.segments import Segment, pack, text_segment
from ernie5.sequence.vision import (
    encode_media,
    generation_segment,
    media_document,
    prompt_ids,
    to_pixels,
    understanding_segment,
)
from ernie5.store.checkpoint import Checkpoint, checkpoint_hash, load_checkpoint
from ernie5.subnets.spec import resolve_specs
from ernie5.tokenizers.special import BOS

FORMAT = 1
"""Version of the golden JSON layout."""
RTOL = 2.5e-4
"""Relative tolerance of a recorded value (see the module docstring for the measurement)."""
ATOL = 2.5e-4
"""Absolute tolerance of a recorded value."""
N_VALUES = 8
"""Logits recorded per fixed row."""
DECIMALS = 5
"""Rounding of every recorded float."""
TEXT_PROMPT = "Question: What is two plus three?\nAnswer: five.\nThe quick brown fox"
"""The text case's prompt (BOS first, as every document)."""
SUBNETS = ("k1", "d0.75-w0.5-k2")
"""Elastic sub-models the text case also runs on (the reference's ES25% and EA points)."""
SEED = "golden"
"""Seed prefix of every procedural input."""
CASES = (
    "text",
    *(f"text@{s}" for s in SUBNETS),
    "image_und",
    "image_gen",
    "clip_und",
    "audio_und",
    "audio_gen",
)
"""Every case a multimodal checkpoint records (a text-only one records the text cases)."""


# ---------------------------------------------------------------------- documents
def _text_doc(ckpt: Checkpoint) -> list[Segment]:
    return [text_segment([BOS, *ckpt.tokenizer.encode(TEXT_PROMPT)])]


def _scene() -> shapes.Scene:
    return shapes.random_scene(random.Random(f"{SEED}/scene"), n_shapes=2)


def _image_und_doc(ckpt: Checkpoint) -> list[Segment]:
    """``BOS BOI <image> EOI`` then a question and answer about the scene (the layout of
    train/pretrain/data.py)."""
    scene = _scene()
    image_HW3 = shapes.render(scene, ckpt.cfg.vision.image_size)
    enc = encode_media(ckpt.vision_tokenizer, to_pixels(image_HW3, clip=False), codes=False)
    qa = shapes.attribute_questions(scene, random.Random(f"{SEED}/question"))[0]
    answer = ckpt.tokenizer.encode(qa_text(qa.question, qa.answer))
    seg = understanding_segment(ckpt.cfg.vision, enc.pixels[0], enc.cnn[0])
    return media_document(seg, "und", 1, [], answer)


def _image_gen_doc(ckpt: Checkpoint) -> list[Segment]:
    """``BOS <prompt> BOI <NFSP positions> EOI EOS``, the scene's bits as teacher-forced targets."""
    scene = _scene()
    image_HW3 = shapes.render(scene, ckpt.cfg.vision.image_size)
    vt = ckpt.vision_tokenizer
    enc = encode_media(vt, to_pixels(image_HW3, clip=False), codes=True, flip_prob=0.0)
    bits = [b[0] for b in enc.bits]
    input_bits = [b[0] for b in enc.input_bits]
    seg = generation_segment(vt, ckpt.cfg.vision, bits, input_bits)
    return media_document(seg, "gen", 1, prompt_ids(ckpt.tokenizer, shapes.prompt_for(scene)), [])


def _clip_und_doc(ckpt: Checkpoint) -> list[Segment]:
    """``BOS BOV <clip> EOV`` then which way the shape moves."""
    rng = random.Random(f"{SEED}/clip")
    shape = shapes.random_scene(rng, n_shapes=1).shapes[0]
    direction = rng.choice(DIRECTIONS)
    clip_THW3, _ = moving_shape_clip(
        shape, direction, rng, n_frames=CLIP_FRAMES, size=ckpt.cfg.vision.image_size
    )
    enc = encode_media(ckpt.vision_tokenizer, to_pixels(clip_THW3, clip=True), codes=False)
    answer = ckpt.tokenizer.encode(qa_text(MOTION_QUESTION, direction))
    seg = understanding_segment(ckpt.cfg.vision, enc.pixels[0], enc.cnn[0])
    return media_document(seg, "und", CLIP_FRAMES, [], answer)


def _dtmf_codes(ckpt: Checkpoint) -> tuple[torch.Tensor, str]:
    """Codec codes ``(n, Q)`` of a seeded two-key DTMF utterance, and its words."""
    u = dtmf_utterance("4#", random.Random(f"{SEED}/dtmf"))
    codec = ckpt.audio_codec
    if codec.sample_rate != 8000:
        raise ValueError(f"{ckpt.path}: the codec reads {codec.sample_rate} Hz; DTMF is rendered at 8000 Hz")
    (codes_NQ,) = audio_docs.encode_waves(codec, [u.wave])
    return codes_NQ, u.text


def _audio_und_doc(ckpt: Checkpoint) -> list[Segment]:
    """``BOS BOA <frames> EOA`` then the transcript (the frames with their speech-content features when
    the model reads them)."""
    codes_NQ, words = _dtmf_codes(ckpt)
    answer = ckpt.tokenizer.encode(transcript_text(words))
    feats = None
    if ckpt.audio_codec.content_encoder is not None:
        u = dtmf_utterance("4#", random.Random(f"{SEED}/dtmf"))
        (feats,) = audio_docs.content_features(ckpt.audio_codec.content_encoder, ckpt.audio_codec, [u.wave])
    return audio_docs.audio_document(audio_docs.understanding_segment(codes_NQ, feats), "und", [], answer)


def _audio_gen_doc(ckpt: Checkpoint) -> list[Segment]:
    """``BOS <Dial: ...> BOA <start> <frames> EOA EOS`` with NCP targets."""
    codes_NQ, words = _dtmf_codes(ckpt)
    prompt = prompt_ids(ckpt.tokenizer, dial_prompt(words))
    return audio_docs.audio_document(audio_docs.generation_segment(codes_NQ), "gen", prompt, [])


_DOCS: dict[str, Callable[[Checkpoint], list[Segment]]] = {
    "image_und": _image_und_doc,
    "image_gen": _image_gen_doc,
    "clip_und": _clip_und_doc,
    "audio_und": _audio_und_doc,
    "audio_gen": _audio_gen_doc,
}


def case_names(ckpt: Checkpoint) -> list[str]:
    """The cases this checkpoint can run: the text cases, plus vision and audio where it has them."""
    vision = ckpt.model.vision is not None and ckpt.vision_tokenizer is not None
    audio = ckpt.model.audio is not None and ckpt.audio_codec is not None
    return [
        c
        for c in CASES
        if c.startswith("text")
        or (vision and c.split("_")[0] in ("image", "clip"))
        or (audio and c.startswith("audio"))
    ]


def case_inputs(ckpt: Checkpoint, case: str) -> Inputs:
    """The packed one-row batch of ``case`` (one document, no padding)."""
    doc = _text_doc(ckpt) if case.startswith("text") else _DOCS[case](ckpt)
    n = sum(len(s) for s in doc)
    return pack([doc], n, n_rows=1, one_per_row=True).inputs


# ---------------------------------------------------------------------- summaries
def _round(x: float) -> float:
    return round(float(x), DECIMALS)


def summarize(logits_NV: torch.Tensor) -> dict[str, Any]:
    """Fixed rows (first, middle, last): first values, argmax, top-2 margin; mean and std of all."""
    x_NV = logits_NV.detach().float().cpu()
    n = x_NV.shape[0]
    rows = sorted({0, n // 2, n - 1})
    top2 = x_NV[rows].topk(min(2, x_NV.shape[1]), dim=-1).values
    margin = (top2[:, 0] - top2[:, -1]).tolist()
    return {
        "shape": list(x_NV.shape),
        "rows": rows,
        "values": [[_round(v) for v in x_NV[r, :N_VALUES].tolist()] for r in rows],
        "argmax": [int(i) for i in x_NV[rows].argmax(-1).tolist()],
        "margin": [_round(m) for m in margin],
        "mean": _round(x_NV.mean()),
        "std": _round(x_NV.std()),
    }


def _outputs(out: ModelOutput) -> dict[str, torch.Tensor]:
    """The recorded outputs of one forward: text logits, bit logits, each NCP level's logits."""
    found = {"text": out.logits_BTV[0]}
    if out.bit_logits_PD is not None:
        found["bits"] = out.bit_logits_PD
    for level, logits_PK in enumerate(out.audio_logits):
        found[f"audio_level{level}"] = logits_PK
    return found


@torch.no_grad()
def golden_forward(ckpt: Checkpoint, cases: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """Summaries of ``ckpt.model``'s outputs on every case it can run (or on ``cases``):
    ``{case: {output: summary}}``.

    The model runs in eval mode (its training flag is restored afterwards) with whatever forward
    paths it has (``load_checkpoint(fast=True)`` is the convention of the golden file).
    """
    model = ckpt.model
    subnets = dict(zip(SUBNETS, resolve_specs(SUBNETS, ckpt), strict=True))
    was_training = model.training
    model.eval()
    try:
        result = {}
        for case in case_names(ckpt) if cases is None else cases:
            spec = case.partition("@")[2]
            inputs = case_inputs(ckpt, case)
            out = model(inputs, subnet=subnets[spec] if spec else None)
            result[case] = {name: summarize(t) for name, t in _outputs(out).items()}
        return result
    finally:
        model.train(was_training)


# ---------------------------------------------------------------------- comparison
def _close(a: float, e: float, rtol: float, atol: float) -> bool:
    return math.isfinite(a) and abs(a - e) <= atol + rtol * abs(e)


def _compare_summary(where: str, a: dict[str, Any], e: dict[str, Any], rtol: float, atol: float) -> list[str]:
    if a["shape"] != e["shape"] or a["rows"] != e["rows"]:
        return [f"{where}: shape {a['shape']} (rows {a['rows']}), expected {e['shape']} (rows {e['rows']})"]
    out = []
    for row, got, want in zip(e["rows"], a["values"], e["values"], strict=True):
        bad = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if not _close(g, w, rtol, atol)]
        if bad:
            diff = max(abs(got[i] - want[i]) for i in bad)
            out.append(f"{where}: row {row} logits {bad} differ (max |diff| {diff:.3g}): {got} != {want}")
    for row, got, want, margin in zip(e["rows"], a["argmax"], e["argmax"], e["margin"], strict=True):
        if got != want and margin > atol + rtol * abs(margin):
            out.append(f"{where}: row {row} argmax {got}, expected {want} (expected margin {margin})")
    for stat in ("mean", "std"):
        if not _close(a[stat], e[stat], rtol, atol):
            out.append(f"{where}: {stat} {a[stat]}, expected {e[stat]}")
    return out


def compare_golden(actual: dict, expected: dict, rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Mismatches between two :func:`golden_forward` results, one line each (empty: they match).

    Each line starts with ``case/output`` (``image_gen/bits``, ``text@k1/text``).
    """
    out = []
    for case in sorted(expected.keys() | actual.keys(), key=lambda c: (c not in CASES, c)):
        if case not in actual or case not in expected:
            out.append(f"{case}: {'missing' if case not in actual else 'not in the golden file'}")
            continue
        for name in sorted(expected[case].keys() | actual[case].keys()):
            where = f"{case}/{name}"
            if name not in actual[case] or name not in expected[case]:
                out.append(f"{where}: {'missing' if name not in actual[case] else 'not in the golden file'}")
                continue
            out += _compare_summary(where, actual[case][name], expected[case][name], rtol, atol)
    return out


def max_difference(actual: dict, expected: dict) -> float:
    """The largest absolute difference of any recorded value (logits, mean, std) of common outputs."""
    worst = 0.0
    for case in actual.keys() & expected.keys():
        for name in actual[case].keys() & expected[case].keys():
            a, e = actual[case][name], expected[case][name]
            pairs = [(a[s], e[s]) for s in ("mean", "std")]
            pairs += [
                p for ra, re in zip(a["values"], e["values"], strict=False) for p in zip(ra, re, strict=False)
            ]
            worst = max([worst, *(abs(x - y) for x, y in pairs)])
    return worst


# ---------------------------------------------------------------------- files and CLI
def golden_record(ckpt: Checkpoint, fast: bool = True) -> dict[str, Any]:
    """The golden file's content: provenance, tolerances and the :func:`golden_forward` cases."""
    return {
        "format": FORMAT,
        "checkpoint_hash": checkpoint_hash(ckpt.path),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "fast": fast,
        "rtol": RTOL,
        "atol": ATOL,
        "cases": golden_forward(ckpt),
    }


def write_golden(path: str | Path, record: dict[str, Any]) -> Path:
    """Write ``record`` as indented, sorted JSON."""
    path = Path(path)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_golden(path: str | Path) -> dict[str, Any]:
    """A golden file written by :func:`write_golden`.

    Raises:
        ValueError: the file is not a golden file of this :data:`FORMAT`.
    """
    record = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(record, dict) or record.get("format") != FORMAT or "cases" not in record:
        raise ValueError(f"{path}: not a golden file of format {FORMAT}")
    return record


def check_golden(ckpt: Checkpoint, path: str | Path) -> list[str]:
    """Mismatch lines of ``ckpt``'s forward against the golden file ``path`` (at its tolerances)."""
    record = read_golden(path)
    lines = []
    if record.get("checkpoint_hash") != checkpoint_hash(ckpt.path):
        lines.append(
            f"checkpoint hash {checkpoint_hash(ckpt.path)}, the golden file was written for "
            f"{record.get('checkpoint_hash')}"
        )
    actual = golden_forward(ckpt)
    return lines + compare_golden(actual, record["cases"], record.get("rtol", RTOL), record.get("atol", ATOL))


def main(argv: list[str] | None = None) -> int:
    """``--write FILE`` records the golden forward; ``--check FILE`` compares (exit 1 on mismatch)."""
    p = argparse.ArgumentParser(prog="python -m tests.store.golden", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder, run folder or 'reference'")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="write the golden JSON")
    mode.add_argument("--check", metavar="FILE", help="compare with a golden JSON")
    p.add_argument("--eager", action="store_true", help="the eager maths instead of the fast paths")
    args = p.parse_args(argv)
    ckpt = load_checkpoint(args.checkpoint, fast=not args.eager)
    if args.write:
        record = golden_record(ckpt, fast=not args.eager)
        print(f"wrote {write_golden(args.write, record)} ({len(record['cases'])} cases)")
        return 0
    lines = check_golden(ckpt, args.check)
    for line in lines:
        print(line, file=sys.stderr)
    print("golden forward matches" if not lines else f"{len(lines)} mismatches")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
