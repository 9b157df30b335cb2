"""The golden forward (``tests.store.golden``) on a micro multimodal checkpoint shipped like the
reference (bf16 parameters, ``load_dtype: float32``): deterministic, round-trips through its file,
insensitive to fast vs eager kernels, and sensitive to a real change of the maths."""

from __future__ import annotations

import pytest
import torch

from ernie5.model.rope import inv_frequencies
from ernie5.store.checkpoint import load_checkpoint, save_checkpoint
from tests.conftest import micro_multimodal_parts
from tests.store import golden


@pytest.fixture(scope="module")
def micro_reference(tmp_path_factory):
    """A micro vision + audio model saved as ``jobs.recipe.export_reference`` saves the reference
    (the multimodal fixture of ``tests/subnets/test_extract.py``, without the refiner)."""
    model, tok, vtok, codec = micro_multimodal_parts()
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    path = tmp_path_factory.mktemp("golden") / "ckpt"
    save_checkpoint(
        path,
        model,
        tokenizer=tok,
        meta={"load_dtype": "float32", "weights_dtype": "bfloat16"},
        vision_tokenizer=vtok,
        audio_codec=codec,
    )
    return path


@pytest.fixture(scope="module")
def expected(micro_reference):
    """The golden record of the fixture checkpoint (fast paths)."""
    return golden.golden_record(load_checkpoint(micro_reference))


def test_every_case_is_recorded_and_deterministic(micro_reference, expected):
    again = golden.golden_forward(load_checkpoint(micro_reference))
    assert list(expected["cases"]) == list(golden.CASES)
    assert set(expected["cases"]["image_gen"]) == {"text", "bits"}
    assert set(expected["cases"]["audio_gen"]) == {"text", "audio_level0", "audio_level1"}
    assert again == expected["cases"]  # bit-identical, not merely within tolerance
    assert golden.compare_golden(again, expected["cases"]) == []


def test_file_round_trip_and_cli(micro_reference, expected, tmp_path, capsys):
    file = golden.write_golden(tmp_path / "golden.json", expected)
    assert golden.read_golden(file) == expected
    assert golden.main(["--checkpoint", str(micro_reference), "--check", str(file)]) == 0
    assert golden.main(["--checkpoint", str(micro_reference), "--write", str(tmp_path / "w.json")]) == 0
    assert golden.read_golden(tmp_path / "w.json") == expected
    assert "matches" in capsys.readouterr().out


def test_fast_and_eager_forwards_agree_within_the_tolerance(micro_reference, expected):
    cases = ("text", "image_gen", "audio_gen")  # the eager MoE loop is slow on CPU: three cases
    eager = golden.golden_forward(load_checkpoint(micro_reference, fast=False), cases)
    want = {c: expected["cases"][c] for c in cases}
    assert golden.compare_golden(eager, want) == []
    assert golden.max_difference(eager, want) <= golden.ATOL / 20  # measured 1e-5: one rounding unit


def test_a_scaled_vision_head_is_a_mismatch_of_the_image_generation_case(micro_reference, expected):
    ckpt = load_checkpoint(micro_reference)
    with torch.no_grad():
        ckpt.model.vision.head.weight.mul_(1.01)
    lines = golden.compare_golden(golden.golden_forward(ckpt), expected["cases"])
    assert lines and all(line.startswith("image_gen/bits: ") for line in lines), lines


def test_a_changed_rope_theta_is_far_outside_the_tolerance(micro_reference, expected):
    ckpt = load_checkpoint(micro_reference)
    ckpt.model.inv_freq.copy_(inv_frequencies(ckpt.cfg.dim_head, ckpt.cfg.rope_theta * 2))
    actual = golden.golden_forward(ckpt)
    lines = golden.compare_golden(actual, expected["cases"])
    assert {line.split("/")[0] for line in lines} == set(golden.CASES)
    assert golden.max_difference(actual, expected["cases"]) > 20 * golden.ATOL


def test_another_checkpoint_fails_the_check_on_its_hash(micro_reference, expected, tmp_path, capsys):
    ckpt = load_checkpoint(micro_reference)
    with torch.no_grad():
        ckpt.model.layers[0].attn.wo.weight.mul_(1.01)
    other = save_checkpoint(
        tmp_path / "other",
        ckpt.model,
        tokenizer=ckpt.tokenizer,
        meta=ckpt.meta,
        vision_tokenizer=ckpt.vision_tokenizer,
        audio_codec=ckpt.audio_codec,
    )
    file = golden.write_golden(tmp_path / "golden.json", expected)
    assert golden.main(["--checkpoint", str(other), "--check", str(file)]) == 1
    assert "checkpoint hash" in capsys.readouterr().err
