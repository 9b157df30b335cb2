"""The shipped ``reference`` checkpoint: present, intact, small, bf16, and still computing what it
computed when it was trained (its golden forward, ``tests.store.golden``).

A missing reference fails (never skips): the package ships it. When a change to the model's maths is
intended, retrain or convert the reference and regenerate the golden file::

    ernie5 recipe reference --out DIR --install
    python -m tests.store.golden --checkpoint reference --write tests/store/golden_reference.json
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ernie5.model.model import Ernie5Model
from ernie5.store.checkpoint import (
    MODEL_FILE,
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    resolve_checkpoint,
)
from tests.store import golden

GOLDEN_FILE = Path(__file__).with_name("golden_reference.json")
MAX_BYTES = 30 * 1024 * 1024
"""The shipped folder's size budget (it travels inside the package)."""
RETRAIN = (
    "the shipped reference's forward changed: retrain or convert the reference "
    "(ernie5 recipe reference --out DIR --install), then regenerate the golden file "
    "(python -m tests.store.golden --checkpoint reference --write tests/store/golden_reference.json)"
)


def _reference_dir() -> Path:
    """The shipped folder; a missing or incomplete one fails the calling test (never skips it)."""
    try:
        return resolve_checkpoint("reference")
    except CheckpointError as e:
        pytest.fail(f"the shipped reference checkpoint is missing (ernie5/reference/meta.json): {e}")


@functools.cache
def _reference() -> Checkpoint:
    """The shipped checkpoint, every file verified against its sha256 manifest (loaded once)."""
    return load_checkpoint(_reference_dir(), verify=True)


def test_the_reference_is_small_and_its_parameters_are_bf16():
    reference_dir, reference = _reference_dir(), _reference()
    size = sum(p.stat().st_size for p in reference_dir.rglob("*") if p.is_file())
    assert size <= MAX_BYTES, f"{reference_dir}: {size / 2**20:.1f} MiB > {MAX_BYTES / 2**20:.0f} MiB"
    with torch.device("meta"):
        params = {name for name, _ in Ernie5Model(reference.cfg).named_parameters()}
    with safe_open(reference_dir / MODEL_FILE, framework="pt") as f:
        stored = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    not_bf16 = sorted(k for k in params & stored.keys() if stored[k] != "BF16")
    assert not not_bf16, f"{reference_dir / MODEL_FILE}: parameters not stored as bf16: {not_bf16[:5]}"
    assert reference.meta.get("load_dtype") == "float32"
    assert all(p.dtype == torch.float32 for p in reference.model.parameters())  # upcast on load
    assert reference.vision_tokenizer is not None and reference.audio_codec is not None
    assert reference.refiner is not None


def test_the_reference_computes_its_golden_forward():
    reference = _reference()
    if not GOLDEN_FILE.is_file():
        pytest.fail(
            f"{GOLDEN_FILE} is missing: generate it with "
            "python -m tests.store.golden --checkpoint reference --write tests/store/golden_reference.json"
        )
    lines = golden.check_golden(reference, GOLDEN_FILE)
    if lines:
        pytest.fail("\n  ".join([RETRAIN, *lines]), pytrace=False)


def test_a_run_can_reuse_the_references_tokenizer_and_codec():
    """``data.vision_tokenizer: reference`` / ``data.audio_codec: reference`` (the multimodal study's
    preset): the parts come out of the shipped checkpoint, identical to what the checkpoint loads."""
    from ernie5.store.checkpoint import load_media_part

    reference = _reference()
    tok = load_media_part("reference", "vision_tokenizer", reference.cfg)
    codec = load_media_part("reference", "audio_codec", reference.cfg)
    for got, want in ((tok, reference.vision_tokenizer), (codec, reference.audio_codec)):
        assert type(got) is type(want) and not got.training
        for (name, a), (_, b) in zip(got.state_dict().items(), want.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="unknown media part 'refiner'"):
        load_media_part("reference", "refiner", reference.cfg)


def test_a_media_part_that_does_not_fit_or_is_missing_is_a_one_line_error(tmp_path):
    import dataclasses

    from ernie5.store.checkpoint import load_media_part

    reference = _reference()
    other = dataclasses.replace(
        reference.cfg, audio=dataclasses.replace(reference.cfg.audio, codebook_size=7)
    )
    with pytest.raises(CheckpointError, match=r"does not fit model\.audio"):
        load_media_part("reference", "audio_codec", other)
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        load_media_part(tmp_path, "vision_tokenizer", reference.cfg)
