"""The vision tokenizer's trainer end to end: the 2D stage, the inflated 3D stage, the output folder."""

from __future__ import annotations

import json

import pytest

from ernie5.tokenizers.vision import VisionTokenizer
from train.side.vision_tokenizer import VisionTokenizerTrainConfig, train_vision_tokenizer


@pytest.mark.slow
def test_train_vision_tokenizer_end_to_end(tmp_path, data_root):

    cfg = VisionTokenizerTrainConfig(
        steps=300,
        batch_size=32,
        video_steps=10,
        video_batch_size=4,
        eval_images=64,
        eval_clips=8,
        log_every=50,
    )
    summary = train_vision_tokenizer(cfg, tmp_path, data_dir=data_root)
    assert (tmp_path / "tokenizer_2d" / "tokenizer.safetensors").is_file()
    assert VisionTokenizer.load(tmp_path / "tokenizer_3d").cfg.mode == "3d"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in records} == {"2d", "3d"} and {r["n_bits"] for r in records} >= {6, 10}
    assert summary["tokenizer_2d"]["shapes/bits10/psnr"] > summary["untrained"]["shapes/bits10/psnr"] + 8
    assert summary["tokenizer_2d"]["mnist/bits10/ssim"] > 0.5
