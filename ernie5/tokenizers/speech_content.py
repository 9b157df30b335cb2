"""A small speech-content encoder: features of *what was said* for audio understanding, and a Whisper in
miniature for the codec's level 1.

ERNIE 5.0 distils its codec's first RVQ level from a Whisper encoder, a network trained to transcribe
many voices, so that level 1 carries what was said. No pretrained speech encoder can be downloaded
here, and at this scale the codec's codes lose what makes speech intelligible across voices: measured
with a small classifier on each representation of FSDD's held-out speaker (v4 sitting), the codes
name the spoken digit 0.37-0.40 of the time, ideal level-1 content units 0.52, log-mel frames 0.81-0.84.
So this encoder serves twice:

* the backbone's understanding frames read its features beside their codes (``audio.content_dim``;
  :mod:`ernie5.model.audio`, deviation 5), as vision understanding reads the tokenizer's features;
* :class:`ContentKMeansTeacher` clusters its features into level-1 targets for the codec (an option:
  measured no better for understanding than the MFCC teacher, and worse for round trips).

    log-mel (40 bins, 10 ms hop, 8 kHz)  --per-utterance mean/variance normalisation-->
    conv stem (stride 2, 50 Hz)  -->  residual dilated conv blocks (per-frame LayerNorm)
        -->  features (B, T, width)  -->  CTC head over characters

Trained by :mod:`train.side.speech_content` with CTC on FSDD's training speakers, eSpeak NG voices and
LJSpeech, every utterance through :func:`ernie5.data.voices.augment_speech`; never on the held-out FSDD
speaker. Its greedy CTC transcripts are a specialist recogniser to set beside the backbone's
(:mod:`evals.specialists`, ``speech_voices``). Frames past an utterance's length are zeroed after every
layer and no statistic crosses frames, so an utterance's features are the same alone or in a batch.

References:
  * ERNIE 5.0 report, arXiv 2602.04705, section 2.3.1: level 1 distilled from a Whisper encoder.
  * Whisper, Radford et al. 2022, arXiv 2212.04356: an encoder trained by supervised transcription of
    many voices; 2x conv downsampling of 10 ms log-mel frames to 50 Hz.
  * HuBERT, Hsu et al. 2021, arXiv 2106.07447: k-means of a trained model's features as targets.
  * CTC, Graves et al. 2006; per-utterance cepstral mean and variance normalisation (CMVN), the
    classic channel and speaker normaliser of speech front ends.

Deviations:
  1. A convolutional encoder of about 0.44 M parameters trained with CTC on characters, not a 39 M+
     Transformer encoder-decoder trained on 680k hours: the data here is spoken digits in a few real
     and many synthetic voices.
  2. Per-utterance mean and variance normalisation of the log-mel bins (Whisper uses a global scaling):
     it removes the stationary part of a voice and a channel before the first layer.
  3. The report feeds understanding from the codes alone; continuous features beside them are this
     project's addition, for the measured reason above.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ernie5.config import check
from ernie5.tokenizers.audio_features import log_mel
from ernie5.tokenizers.folder import load_module, save_module
from ernie5.tokenizers.teacher_kmeans import TEACHER_VERSION, KMeansTeacher, write_teacher_folder

VERSION = "ernie5-speech-content/1"
WEIGHTS_FILE = "speech_content.safetensors"
ALPHABET = " abcdefghijklmnopqrstuvwxyz"
"""CTC symbols after the blank (id 0): space, then a-z (the alphabet of normalised transcripts)."""


class SpeechContentError(ValueError):
    """A saved speech-content encoder that cannot be loaded (one line naming the file)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SpeechContentConfig:
    """Shape of the content encoder."""

    sample_rate: int = 8000
    """Sample rate (Hz) of the waveforms it reads."""
    n_mels: int = 40
    """Log-mel bins of its input (256-point FFT, 10 ms hop at 8 kHz)."""
    width: int = 128
    """Channels of every conv layer and the width of its features."""
    kernel: int = 5
    """Kernel of the stem and of every block's dilated conv."""
    dilations: tuple[int, ...] = (1, 2, 4, 8, 1)
    """One residual block per entry, with this dilation (receptive field grows with their sum)."""
    dropout: float = 0.1
    """Dropout inside the blocks (training only)."""

    def __post_init__(self) -> None:
        check(self.sample_rate >= 1000, f"sample_rate={self.sample_rate} must be >= 1000")
        check(self.n_mels >= 8, f"n_mels={self.n_mels} must be >= 8")
        check(self.width >= 8, f"width={self.width} must be >= 8")
        check(self.kernel >= 1 and self.kernel % 2 == 1, f"kernel={self.kernel} must be odd and >= 1")
        check(len(self.dilations) >= 1 and all(d >= 1 for d in self.dilations), "dilations must be >= 1")
        check(0.0 <= self.dropout < 1.0, f"dropout={self.dropout} must be in [0, 1)")

    @property
    def hop(self) -> int:
        """Samples per log-mel frame (10 ms)."""
        return round(0.010 * self.sample_rate)

    @property
    def n_fft(self) -> int:
        """FFT size of the log-mel frames (about 32 ms)."""
        return 256 * self.sample_rate // 8000


class _FrameNorm(nn.LayerNorm):
    """LayerNorm over the channels of each frame of ``(B, C, T)``: no statistic crosses frames, so an
    utterance's features do not depend on the padding beside it."""

    def forward(self, x_BCT: Tensor) -> Tensor:
        return super().forward(x_BCT.transpose(1, 2)).transpose(1, 2)


class _Block(nn.Module):
    def __init__(self, width: int, kernel: int, dilation: int, dropout: float) -> None:
        super().__init__()
        self.conv = nn.Conv1d(width, width, kernel, padding=dilation * (kernel // 2), dilation=dilation)
        self.norm = _FrameNorm(width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x_BCT: Tensor) -> Tensor:
        return x_BCT + self.drop(F.gelu(self.norm(self.conv(x_BCT))))


class SpeechContentEncoder(nn.Module):
    """Log-mel -> 50 Hz content features ``(B, T, width)`` and CTC logits over :data:`ALPHABET` + blank."""

    def __init__(self, cfg: SpeechContentConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.stem = nn.Conv1d(cfg.n_mels, w, cfg.kernel, stride=2, padding=cfg.kernel // 2)
        self.blocks = nn.ModuleList(_Block(w, cfg.kernel, d, cfg.dropout) for d in cfg.dilations)
        self.norm = _FrameNorm(w)
        self.head = nn.Linear(w, 1 + len(ALPHABET))

    @property
    def frame_rate(self) -> float:
        """Feature frames per second (50 at the default 10 ms hop)."""
        return self.cfg.sample_rate / self.cfg.hop / 2

    def n_frames(self, n_samples: Tensor | int) -> Tensor | int:
        """Feature frames that cover ``n_samples`` samples (the stem's output length)."""
        n_mel = 1 + n_samples // self.cfg.hop
        return (n_mel + 1) // 2

    def log_mel(self, wave_BS: Tensor, lengths_B: Tensor | None = None) -> Tensor:
        """Per-utterance normalised log-mel ``(B, n_mels, T_mel)``; statistics over each utterance's own
        frames (``lengths_B`` samples; None = the whole row), padded frames set to 0."""
        c = self.cfg
        x_BMT = log_mel(wave_BS.float(), c.sample_rate, n_fft=c.n_fft, hop=c.hop, n_mels=c.n_mels, eps=1e-6)
        T = x_BMT.shape[-1]
        if lengths_B is None:
            valid_BT = torch.ones(x_BMT.shape[0], T, dtype=torch.bool, device=x_BMT.device)
        else:
            n_B = (1 + lengths_B.to(x_BMT.device) // c.hop).clamp(max=T)
            valid_BT = torch.arange(T, device=x_BMT.device)[None] < n_B[:, None]
        m_B1T = valid_BT[:, None].to(x_BMT.dtype)
        count = m_B1T.sum(-1, keepdim=True).clamp_min(1.0)
        mean = (x_BMT * m_B1T).sum(-1, keepdim=True) / count
        var = ((x_BMT - mean).square() * m_B1T).sum(-1, keepdim=True) / count
        return (x_BMT - mean) / (var + 1e-5).sqrt() * m_B1T

    def features(self, wave_BS: Tensor, lengths_B: Tensor | None = None) -> Tensor:
        """Content features ``(B, T, width)`` at :attr:`frame_rate`. Frames past an utterance's
        ``lengths_B`` samples are zeroed after every layer, so its features are the same alone or
        padded in a batch (frames it covers; the last one or two may still see the padding's zeros)."""
        h_BCT = self.stem(self.log_mel(wave_BS, lengths_B))
        mask_B1T = None
        if lengths_B is not None:
            n_B = torch.as_tensor(self.n_frames(lengths_B.to(h_BCT.device)))
            mask_B1T = (torch.arange(h_BCT.shape[-1], device=h_BCT.device)[None] < n_B[:, None])[:, None]
            mask_B1T = mask_B1T.to(h_BCT.dtype)
            h_BCT = h_BCT * mask_B1T
        for block in self.blocks:
            h_BCT = block(h_BCT)
            if mask_B1T is not None:
                h_BCT = h_BCT * mask_B1T
        out_BCT = self.norm(h_BCT)
        return (out_BCT if mask_B1T is None else out_BCT * mask_B1T).transpose(1, 2)

    def forward(self, wave_BS: Tensor, lengths_B: Tensor | None = None) -> Tensor:
        """CTC log-probabilities ``(B, T, 1 + len(ALPHABET))``."""
        return self.head(self.features(wave_BS, lengths_B)).log_softmax(-1)

    @torch.no_grad()
    def transcribe(self, wave_BS: Tensor, lengths_B: Tensor | None = None) -> list[str]:
        """Greedy CTC transcripts (repeats merged, blanks dropped, spaces collapsed)."""
        ids_BT = self(wave_BS, lengths_B).argmax(-1)
        n_B = (
            [ids_BT.shape[1]] * ids_BT.shape[0]
            if lengths_B is None
            else [int(self.n_frames(int(n))) for n in lengths_B]
        )
        return [ctc_greedy(row[:n].tolist()) for row, n in zip(ids_BT, n_B)]

    def save(self, path: str | Path, meta: dict[str, Any] | None = None) -> Path:
        """Write ``path/`` atomically: weights, ``config.yaml``, ``meta.json``."""
        return save_module(path, self, self.cfg, VERSION, WEIGHTS_FILE, meta)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> SpeechContentEncoder:
        """Load a folder written by :meth:`save` (no pickle), frozen and in eval mode."""
        model = load_module(
            path,
            cls,
            SpeechContentConfig,
            VERSION,
            WEIGHTS_FILE,
            SpeechContentError,
            "speech encoder",
            device,
        )
        return model.eval().requires_grad_(False)


def encode_text(text: str) -> list[int]:
    """CTC target ids of a normalised transcript (characters outside :data:`ALPHABET` are an error)."""
    bad = sorted({ch for ch in text if ch not in ALPHABET})
    if bad:
        raise ValueError(f"transcript {text!r} has characters {bad} outside a-z and space (normalise it)")
    return [1 + ALPHABET.index(ch) for ch in text]


def ctc_greedy(ids: list[int]) -> str:
    """The string of a frame-wise arg-max path: repeats merged, blanks (0) dropped, spaces collapsed."""
    out, prev = [], -1
    for i in ids:
        if i != prev and i != 0:
            out.append(ALPHABET[i - 1])
        prev = i
    return " ".join("".join(out).split())


# ---------------------------------------------------------------------- as the codec's teacher
class ContentKMeansTeacher(KMeansTeacher):
    """HuBERT-iteration-2-style teacher: k-means cluster ids of a trained speech-content encoder's
    features (:class:`~ernie5.tokenizers.speech_content.SpeechContentEncoder`, trained to transcribe many
    voices), so that the clusters are units of what was said rather than of who said it.

    The encoder's weights travel inside the teacher's folder (``encoder.*`` tensors of
    ``teacher.safetensors``, its config in ``teacher.json``).
    """

    kind = "content_kmeans"

    def __init__(self, encoder: Any, n_clusters: int = 64) -> None:
        super().__init__(n_clusters)
        self.encoder = encoder.eval().requires_grad_(False)

    @property
    def feature_dim(self) -> int:
        """The encoder's width."""
        return int(self.encoder.cfg.width)

    @torch.no_grad()
    def features(self, wave_BS: Tensor, sample_rate: int) -> Tensor:
        """The encoder's features ``(B, T, width)`` at 50 Hz (the waveform must be at its sample rate)."""
        if sample_rate != self.encoder.cfg.sample_rate:
            raise ValueError(
                f"ContentKMeansTeacher: audio at {sample_rate} Hz, the encoder reads "
                f"{self.encoder.cfg.sample_rate} Hz"
            )
        device = next(self.encoder.parameters()).device
        return self.encoder.features(wave_BS.float().to(device)).float().to(wave_BS.device)

    def save(self, path: str | Path) -> Path:
        """Write ``teacher.json`` (K, the encoder's config) and ``teacher.safetensors`` (encoder weights
        and, when fitted, the standardisation and centroids) to the folder ``path``."""
        from dataclasses import asdict

        body = {
            "version": TEACHER_VERSION,
            "kind": self.kind,
            "n_clusters": self.n_clusters,
            "encoder": asdict(self.encoder.cfg),
        }
        state = {f"encoder.{k}": v for k, v in self.encoder.state_dict().items()} | self._kmeans_state()
        return write_teacher_folder(Path(path), body, state)


def load_content_teacher(path: Path, body: dict[str, Any], state: dict[str, Tensor]) -> ContentKMeansTeacher:
    """The ``content_kmeans`` teacher of a saved folder (:func:`ernie5.tokenizers.audio_teacher.load_teacher`
    reads ``teacher.json`` and the state and calls this)."""
    from ernie5.config import ConfigError, from_dict

    try:
        encoder = SpeechContentEncoder(from_dict(SpeechContentConfig, body.get("encoder") or {}))
    except ConfigError as e:
        raise ValueError(f"{path / 'teacher.json'}: encoder: {e}") from None
    weights = {k.removeprefix("encoder."): v for k, v in state.items() if k.startswith("encoder.")}
    try:
        encoder.load_state_dict(weights)
    except RuntimeError as e:
        raise ValueError(f"{path / 'teacher.safetensors'}: {str(e).splitlines()[0]}") from None
    teacher = ContentKMeansTeacher(encoder, body["n_clusters"])
    teacher._set_kmeans_state(state)
    return teacher
