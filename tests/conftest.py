"""Shared fixtures: offline environment, tiny configs, deterministic torch state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _torch_state():
    """Restore dtype, seed and thread count around every test."""
    dtype, threads = torch.get_default_dtype(), torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The real data root (``$ERNIE5_DATA_DIR``, else ``../shared/data`` beside the project);
    skips the test when absent."""
    root = Path(os.environ.get("ERNIE5_DATA_DIR") or SHARED_DATA)
    if not root.is_dir():
        pytest.skip(f"no real data root at {root}")
    return root


def tiny_config(**overrides):
    """A few-thousand-parameter model config for unit tests."""
    from ernie5.model.config import ModelConfig, MoEConfig

    moe = overrides.pop("moe", {})
    base = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=128)
    base.update(overrides)
    moe_kw = dict(n_experts=8, d_expert=16, top_k=2, n_shared_experts=1)
    moe_kw.update(moe)
    return ModelConfig(**base, moe=MoEConfig(**moe_kw))


@pytest.fixture
def tiny_cfg():
    """The default tiny config."""
    return tiny_config()


def cli_env(**extra: str) -> dict[str, str]:
    """Environment for a subprocess running the CLI from this checkout, offline, without a data root."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", **extra)
    env.pop("ERNIE5_DATA_DIR", None)
    return env


def accelerate_prefix(n_processes: int = 2) -> list[str]:
    """``accelerate launch`` for ``n`` data-parallel CPU processes (torchrun + gloo; ``--cpu`` starts one)."""
    import sys

    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(n_processes),
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ]


def without_manifest(path) -> None:
    """Drop the sha256 manifest from a side-model folder's ``meta.json`` (as in a folder saved before
    manifests), so that the checks behind the manifest are reached."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(meta, dict) and meta.pop("files", None) is not None:
        (path / "meta.json").write_text(json.dumps(meta))


def micro_multimodal_parts():
    """An untrained micro model with vision and audio and its side parts, seeded:
    ``(model, text tokenizer, 3D vision tokenizer, audio codec)`` (for checkpoint-level tests)."""
    from ernie5.config import load
    from ernie5.model.model import Ernie5Model
    from ernie5.presets import resolve_config_path
    from ernie5.tokenizers.audio_codec import AudioCodec
    from ernie5.tokenizers.audio_config import AudioCodecConfig
    from ernie5.tokenizers.text import TextTokenizer
    from ernie5.tokenizers.vision import VisionTokenizer
    from ernie5.tokenizers.vision_config import VisionTokenizerConfig
    from train.pretrain.config import RunConfig

    torch.manual_seed(0)
    cfg = load(
        RunConfig,
        resolve_config_path("micro"),
        [
            "model.vision.enabled=true",
            "model.vision.cnn_channels=16",
            "model.vision.latent_bits=6",
            "model.vision.vit_dim=16",
            "model.vision.vit_layers=1",
            "model.vision.vit_heads=2",
            "model.audio.enabled=true",
            "model.audio.n_levels=2",
            "model.audio.codebook_size=16",
        ],
    ).model
    vtok = VisionTokenizer(
        VisionTokenizerConfig(base_channels=8, channel_mult=(1, 2), norm_groups=4, latent_bits=6, mode="3d")
    )
    codec = AudioCodec(
        AudioCodecConfig(channels=4, max_channels=16, latent_dim=8, n_levels=2, codebook_size=16)
    )
    corpus = [f"Question: which digit is spoken? Answer: {w}." for w in ("one", "two", "three")] * 50
    return Ernie5Model(cfg), TextTokenizer.train(corpus, 300), vtok, codec
