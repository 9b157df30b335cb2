"""FP8 is guarded: on a machine that cannot run it, asking for it is a one-line error before any
training, and nothing imports torchao otherwise. On a GPU with FP8 (capability >= 8.9) and torchao,
a few training steps in FP8 follow the bf16 ones within tolerance."""

from __future__ import annotations

import pytest
import torch

from ernie5.config import load
from ernie5.model.model import Ernie5Model
from ernie5.presets import resolve_config_path
from train.config import RunConfig
from train.loop import RunError, pretrain
from train.parallel.fp8 import FP8Error, apply_fp8, fp8_supported


def test_fp8_on_cpu_is_a_one_line_error(tmp_path):
    assert fp8_supported(torch.device("cpu")) == "train.fp8 needs a CUDA GPU (this run is on cpu)"
    cfg = load(RunConfig, resolve_config_path("micro"))
    with pytest.raises(FP8Error, match="needs a CUDA GPU"):
        apply_fp8(Ernie5Model(cfg.model), torch.device("cpu"))
    cfg = load(
        RunConfig, resolve_config_path("micro"), ["train.fp8=true", "train.device=cpu", "train.steps=1"]
    )
    with pytest.raises(RunError, match=r"^train.fp8 needs a CUDA GPU \(this run is on cpu\)$"):
        pretrain(cfg, tmp_path / "run", quiet=True)


@pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_supported(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with FP8 (capability >= 8.9) and torchao",
)
def test_fp8_training_follows_bf16(tmp_path):
    sets = [
        "train.steps=20",
        "train.log_every=1",
        "train.dtype=bf16",
        "train.device=cuda",
        "elastic.enabled=false",
    ]
    sets.append("data.tokenizer_chars=20000")
    base = load(RunConfig, resolve_config_path("nano"), sets)
    fp8 = load(RunConfig, resolve_config_path("nano"), [*sets, "train.fp8=true"])
    a = pretrain(base, tmp_path / "bf16", quiet=True)
    b = pretrain(fp8, tmp_path / "fp8", quiet=True)
    assert b["loss"] == pytest.approx(a["loss"], rel=0.03)
