"""The frozen media models a pretraining run tokenizes with and ships in its checkpoints: the vision
tokenizer (``data.vision_tokenizer``), the audio codec (``data.audio_codec``) and the cascaded refiner
(``data.refiner``).

Each key names either the folder the part's own trainer wrote (:mod:`train.side`) or, for the tokenizer
and the codec, a checkpoint that carries one (``reference``, a checkpoint or run folder), which
:func:`ernie5.store.checkpoint.load_media_part` loads and checks. Every failure is a one-line
:class:`~train.common.run_folder.RunError` naming the key.
"""

from __future__ import annotations

from typing import Any

from ernie5.store.checkpoint import (
    CheckpointError,
    check_vision_fits,
    load_media_part,
    names_media_checkpoint,
)
from train.common.run_folder import RunError
from train.pretrain.config import RunConfig


def _checkpoint_part(value: str, part: str, model_cfg) -> Any:
    """The frozen tokenizer or codec a checkpoint carries (``data.<part>`` names a checkpoint), or a
    one-line ``RunError`` naming the key."""
    try:
        return load_media_part(value, part, model_cfg)
    except CheckpointError as e:
        raise RunError(f"data.{part}={value!r}: {str(e).splitlines()[0]}") from None


def load_audio_codec(cfg: RunConfig):
    """The frozen audio codec named by ``data.audio_codec`` (audio models only)."""
    if not cfg.model.audio.enabled:
        return None
    if not cfg.data.audio_codec:
        raise RunError(
            "model.audio.enabled needs data.audio_codec (a folder written by ernie5 train-audio-codec)"
        )
    from ernie5.store.checkpoint import check_codec_fits
    from ernie5.tokenizers.audio_codec import AudioCodec

    if names_media_checkpoint(cfg.data.audio_codec, "audio_codec"):
        return with_speech_encoder(_checkpoint_part(cfg.data.audio_codec, "audio_codec", cfg.model), cfg)
    try:
        codec = AudioCodec.load(cfg.data.audio_codec)
    except (ValueError, OSError) as e:
        raise RunError(f"data.audio_codec: {str(e).splitlines()[0]}") from None
    check_codec_fits(codec.cfg, cfg.model, "data.audio_codec", RunError)
    return with_speech_encoder(codec.eval().requires_grad_(False), cfg)


def with_speech_encoder(codec, cfg: RunConfig):
    """``codec`` with ``data.speech_encoder`` attached (when named), checked against
    ``model.audio.content_dim``: a model that reads content features gets an encoder of their width."""
    from ernie5.store.checkpoint import check_content_fits

    if codec is None:
        return None
    if cfg.data.speech_encoder:
        from ernie5.tokenizers.speech_content import SpeechContentEncoder

        value = cfg.data.speech_encoder
        if names_media_checkpoint(value, "audio_codec"):
            encoder = _checkpoint_part(value, "audio_codec", cfg.model).content_encoder
        else:
            try:
                encoder = SpeechContentEncoder.load(value)
            except (ValueError, OSError) as e:
                raise RunError(f"data.speech_encoder: {str(e).splitlines()[0]}") from None
        codec.attach_content_encoder(encoder)
    check_content_fits(codec.content_encoder, cfg.model, "data.speech_encoder", RunError)
    return codec


def load_vision_tokenizer(cfg: RunConfig):
    """The frozen vision tokenizer named by ``data.vision_tokenizer`` (vision models only)."""
    if not cfg.model.vision.enabled:
        return None
    if not cfg.data.vision_tokenizer:
        raise RunError(
            "model.vision.enabled needs data.vision_tokenizer "
            "(a folder written by ernie5 train-vision-tokenizer)"
        )
    from ernie5.tokenizers.vision import VisionTokenizer, VisionTokenizerError

    if names_media_checkpoint(cfg.data.vision_tokenizer, "vision_tokenizer"):
        return _checkpoint_part(cfg.data.vision_tokenizer, "vision_tokenizer", cfg.model)
    try:
        tok = VisionTokenizer.load(cfg.data.vision_tokenizer)
    except (VisionTokenizerError, OSError) as e:
        raise RunError(f"data.vision_tokenizer: {str(e).splitlines()[0]}") from None
    check_vision_fits(tok.cfg, cfg.model, "data.vision_tokenizer", RunError)
    return tok.eval().requires_grad_(False)


def load_refiner(cfg: RunConfig):
    """The frozen cascaded refiner named by ``data.refiner`` (shipped in checkpoints), if any."""
    if not cfg.data.refiner:
        return None
    from ernie5.tokenizers.refiner import Refiner, RefinerError

    try:
        return Refiner.load(cfg.data.refiner).eval().requires_grad_(False)
    except (RefinerError, OSError) as e:
        raise RunError(f"data.refiner: {str(e).splitlines()[0]}") from None
