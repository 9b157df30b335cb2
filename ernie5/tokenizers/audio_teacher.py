"""Semantic teachers for the audio codec's level-1 distillation (pluggable).

A teacher maps a waveform to frame features at its own frame rate; the codec average-pools them to its
frame rate (:func:`pool_to_frames`, via :meth:`~ernie5.tokenizers.audio_codec.AudioCodec.teacher_targets`)
and trains its semantic head on level 1's quantised vectors against them with the teacher's ``loss``::

    feats_BTD = teacher.features(wave_BS, sample_rate)      # any frame rate
    targets_BND = pool_to_frames(feats_BTD, n_frames)        # codec frame rate, average pooling
    loss = teacher.loss(codec.semantic(level1_BDN), targets_BND)

Three teachers:

* :class:`MFCCKMeansTeacher` (needs no download nor training): HuBERT-iteration-1-style targets. Frames
  are 13 MFCCs with deltas and delta-deltas (39 dims, 10 ms hop at 8 kHz), pooled to the codec frame
  rate, standardised per dimension and assigned to the nearest of K k-means centroids fitted (seeded) on
  training audio. The distillation target is the cluster id; the loss is the cross-entropy of the
  codec's linear semantic head (``latent_dim -> K`` logits) on level 1's quantised vector. So level 1
  must carry what tells the K phonetic-ish clusters apart. The mean, std and centroids are its state
  (:meth:`MFCCKMeansTeacher.save` / :func:`load_teacher`). MFCCs describe a voice as much as a word:
  level 1 taught by them carries the speaker.
* :class:`~ernie5.tokenizers.speech_content.ContentKMeansTeacher` (an option, measured in the v4
  sitting): the same k-means targets over the features
  of a small speech-content encoder trained by CTC transcription over many voices
  (:mod:`ernie5.tokenizers.speech_content`, a Whisper in miniature), as HuBERT's second iteration
  clusters a trained model's features instead of MFCCs.
* :class:`WhisperTeacher` (optional; needs ``transformers`` and Whisper weights): the output of a Whisper
  encoder on the waveform resampled to 16 kHz (50 Hz frames), pooled to the codec frame rate; loss
  ``1 - cos(head(level1), feature)`` averaged over frames, as in the ERNIE 5.0 report. Its weights are
  loaded from safetensors only: the source is read from a side model's ``teacher.json``, and pickled
  weights would run code on load.

A saved teacher is a side-model folder (:mod:`ernie5.tokenizers.folder`): ``teacher.json`` carries the
sha256 manifest of the state file and is written last; the folder is published atomically.

References:
  * ERNIE 5.0 report, arXiv 2602.04705, section 2.3.1: level 1 distilled from a Whisper encoder whose
    outputs are average-pooled to the token rate.
  * HuBERT, Hsu et al. 2021, arXiv 2106.07447: first-iteration targets = k-means (K=100) of MFCC
    (+ deltas) frames, later iterations k-means of a trained model's features; cross-entropy on
    cluster ids.
  * SpeechTokenizer, Zhang et al. 2024, arXiv 2308.16692: linear projection of RVQ-1 distilled to a
    speech SSL teacher with a cosine loss.
  * Whisper, Radford et al. 2022, arXiv 2212.04356: 16 kHz, 80-bin log-mel (25 ms window, 10 ms hop),
    ``log10``, clamp to ``max - 8``, ``(x + 4) / 4``, 30 s windows, 2x conv downsampling to 50 Hz.

Deviations:
  1. The in-project teachers stand in for Whisper: no pretrained speech encoder can be downloaded
     here and the data (8 kHz digits, DTMF) is tiny. The MFCC k-means proxy (the codec config's
     default, K = 64) carries coarse spectral class; the content teacher's encoder is trained for
     transcription like Whisper, at a tiny scale, and its cluster ids (not its features) are the
     targets.
  2. MFCC frames are pooled to the codec rate before clustering (HuBERT clusters 100 Hz frames), so a
     target is the class of a whole 40-80 ms codec frame.
  3. The Whisper adapter processes one window (30 s for released models) per utterance and refuses
     longer input; its features are the last encoder layer by default (``layer`` selects another).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from ernie5.tokenizers.audio_features import deltas, mfcc
from ernie5.tokenizers.folder import read_index, verify_files
from ernie5.tokenizers.teacher_kmeans import (
    STATE_FILE,
    TEACHER_FILE,
    TEACHER_VERSION,
    KMeansTeacher,
    write_teacher_folder,
)


@runtime_checkable
class SemanticTeacher(Protocol):
    """What the codec needs from a teacher."""

    kind: str
    """``"mfcc_kmeans"``, ``"content_kmeans"`` or ``"whisper"`` (the codec config's ``teacher``)."""

    @property
    def target_dim(self) -> int:
        """Width the codec's semantic head must output (K clusters, or the feature width)."""
        ...

    def features(self, wave_BS: Tensor, sample_rate: int) -> Tensor:
        """Frame features ``(B, T, D_t)`` of waveforms ``(B, S)`` at any frame rate covering the waveform."""
        ...

    def loss(self, pred_BNK: Tensor, targets_BND: Tensor) -> Tensor:
        """Scalar distillation loss of the semantic head's output against pooled features."""
        ...

    def save(self, path: str | Path) -> Path:
        """Write the teacher's description (and state) to the folder ``path``."""
        ...


def pool_to_frames(feats_BTD: Tensor, n_frames: int) -> Tensor:
    """Average-pool features ``(B, T, D)`` spanning a waveform to ``(B, n_frames, D)`` spanning the same.

    Frame n is the mean of the teacher frames ``floor(n T / N) .. ceil((n+1) T / N) - 1`` (adaptive average
    pooling), so the two frame grids are aligned at both ends.
    """
    if feats_BTD.ndim != 3:
        raise ValueError(f"features must be (B, T, D), got {tuple(feats_BTD.shape)}")
    if n_frames < 1 or feats_BTD.shape[1] < 1:
        raise ValueError(f"need n_frames >= 1 and T >= 1, got {n_frames} and {feats_BTD.shape[1]}")
    return F.adaptive_avg_pool1d(feats_BTD.transpose(1, 2), n_frames).transpose(1, 2)


class MFCCKMeansTeacher(KMeansTeacher):
    """HuBERT-iteration-1-style teacher: k-means cluster ids of pooled MFCC + delta + delta-delta frames."""

    kind = "mfcc_kmeans"

    def __init__(self, n_clusters: int = 64, n_mfcc: int = 13, n_mels: int = 40) -> None:
        if n_clusters < 2 or not 1 <= n_mfcc <= n_mels:
            raise ValueError(f"need n_clusters >= 2 and 1 <= n_mfcc <= n_mels, got {n_clusters}, {n_mfcc}")
        super().__init__(n_clusters)
        self.n_mfcc, self.n_mels = n_mfcc, n_mels

    @property
    def feature_dim(self) -> int:
        """Dimensions of one feature frame: ``3 * n_mfcc``."""
        return 3 * self.n_mfcc

    @torch.no_grad()
    def features(self, wave_BS: Tensor, sample_rate: int) -> Tensor:
        """MFCC + delta + delta-delta frames ``(B, T, 3 * n_mfcc)``: 32 ms windows (power-of-two FFT of
        about 32 ms) with a 10 ms hop, ``T = 1 + S // hop`` (centred)."""
        hop = max(1, round(0.010 * sample_rate))
        n_fft = 2 ** max(1, round(math.log2(0.032 * sample_rate)))
        c_BCT = mfcc(
            wave_BS.float(), sample_rate, n_mfcc=self.n_mfcc, n_fft=n_fft, hop=hop, n_mels=self.n_mels
        )
        d1 = deltas(c_BCT)
        return torch.cat([c_BCT, d1, deltas(d1)], dim=1).transpose(1, 2)

    def save(self, path: str | Path) -> Path:
        """Write ``teacher.json`` and (when fitted) ``teacher.safetensors`` to the folder ``path``."""
        body = {
            "version": TEACHER_VERSION,
            "kind": self.kind,
            "n_clusters": self.n_clusters,
            "n_mfcc": self.n_mfcc,
            "n_mels": self.n_mels,
        }
        return write_teacher_folder(Path(path), body, self._kmeans_state() or None)


# ---------------------------------------------------------------------- Whisper
def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "WhisperTeacher needs the optional package transformers (pip install transformers)"
        ) from None
    return transformers


def resample_fft(wave_BS: Tensor, orig_sr: int, new_sr: int) -> Tensor:
    """Band-limited resampling by zero-padding / truncating the spectrum (``scipy.signal.resample``):
    ``(B, S) -> (B, round(S * new_sr / orig_sr))``."""
    if orig_sr == new_sr:
        return wave_BS
    S = wave_BS.shape[-1]
    n_out = round(S * new_sr / orig_sr)
    spec = torch.fft.rfft(wave_BS.double(), dim=-1)
    n_bins = n_out // 2 + 1
    if spec.shape[-1] < n_bins:
        spec = F.pad(spec, (0, n_bins - spec.shape[-1]))
    else:
        spec = spec[..., :n_bins]
    return (torch.fft.irfft(spec, n=n_out, dim=-1) * (n_out / S)).to(wave_BS.dtype)


class WhisperTeacher:
    """Adapter around a ``transformers`` Whisper encoder (frozen, eval mode).

    Build it with :meth:`from_pretrained` (a model id or local folder; weights must be available offline)
    or :meth:`from_config` (random weights, for tests).
    """

    kind = "whisper"
    SAMPLE_RATE = 16000
    HOP = 160
    N_FFT = 400

    def __init__(self, encoder: Any, source: str | None = None, layer: int = -1) -> None:
        transformers = _import_transformers()
        self.encoder = encoder.eval().requires_grad_(False)
        self.config = encoder.config
        self.source, self.layer = source, layer
        self.n_mels = int(self.config.num_mel_bins)
        self.n_frames_window = 2 * int(self.config.max_source_positions)
        filters = transformers.audio_utils.mel_filter_bank(
            num_frequency_bins=1 + self.N_FFT // 2,
            num_mel_filters=self.n_mels,
            min_frequency=0.0,
            max_frequency=8000.0,
            sampling_rate=self.SAMPLE_RATE,
            norm="slaney",
            mel_scale="slaney",
        )
        self.mel_filters_FM = torch.as_tensor(filters, dtype=torch.float32)

    @classmethod
    def from_pretrained(cls, name_or_path: str, layer: int = -1) -> WhisperTeacher:
        """The encoder of ``transformers.WhisperModel.from_pretrained(name_or_path, use_safetensors=True)``.

        Only safetensors weights are loaded: ``name_or_path`` may come from a side model's
        ``teacher.json``, and a pickled ``pytorch_model.bin`` can run code when loaded.

        Raises:
            ValueError: one line naming ``name_or_path`` when it has no loadable safetensors weights
                (no such folder or model, or only pickled weights).
        """
        transformers = _import_transformers()
        try:
            model = transformers.WhisperModel.from_pretrained(name_or_path, use_safetensors=True)
        except (OSError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(
                f"WhisperTeacher: {name_or_path!r} has no loadable safetensors weights ({reason}); "
                "only safetensors are loaded (pickled .bin weights can run code)"
            ) from None
        return cls(model.get_encoder(), source=name_or_path, layer=layer)

    @classmethod
    def from_config(cls, config: Any, layer: int = -1) -> WhisperTeacher:
        """A randomly initialised encoder of a ``transformers.WhisperConfig`` (tests)."""
        _import_transformers()
        from transformers.models.whisper.modeling_whisper import WhisperEncoder

        return cls(WhisperEncoder(config), source=None, layer=layer)

    @property
    def target_dim(self) -> int:
        """The encoder width ``d_model`` (384 for whisper-tiny)."""
        return int(self.config.d_model)

    @property
    def window_samples(self) -> int:
        """16 kHz samples of one encoder window (480,000 = 30 s for released models)."""
        return self.n_frames_window * self.HOP

    def log_mel(self, wave16_BS: Tensor) -> Tensor:
        """Whisper's log-mel ``(B, n_mels, n_frames_window)`` of 16 kHz audio zero-padded to one window."""
        S = wave16_BS.shape[-1]
        x = F.pad(wave16_BS.float(), (0, self.window_samples - S))
        window = torch.hann_window(self.N_FFT, device=x.device)
        spec = torch.stft(x, self.N_FFT, self.HOP, window=window, return_complex=True)
        power_BFT = spec[..., :-1].abs().square()
        mel_BMT = torch.einsum("fm,bft->bmt", self.mel_filters_FM.to(x.device), power_BFT)
        log_BMT = mel_BMT.clamp_min(1e-10).log10()
        log_BMT = torch.maximum(log_BMT, log_BMT.amax(dim=(1, 2), keepdim=True) - 8.0)
        return (log_BMT + 4.0) / 4.0

    @torch.no_grad()
    def features(self, wave_BS: Tensor, sample_rate: int) -> Tensor:
        """Encoder states ``(B, ceil(S16 / 320), d_model)`` (50 Hz) of the waveform resampled to 16 kHz."""
        wave16 = resample_fft(wave_BS.float(), sample_rate, self.SAMPLE_RATE)
        S16 = wave16.shape[-1]
        if self.window_samples < S16:
            raise ValueError(
                f"WhisperTeacher: {S16 / self.SAMPLE_RATE:.2f} s is longer than one encoder window "
                f"({self.window_samples / self.SAMPLE_RATE:.2f} s); crop the audio"
            )
        device = next(self.encoder.parameters()).device
        mel = self.log_mel(wave16.to(device))
        out = self.encoder(mel, output_hidden_states=self.layer != -1)
        states_BTD = out.last_hidden_state if self.layer == -1 else out.hidden_states[self.layer]
        n_valid = max(1, -(-S16 // (2 * self.HOP)))
        return states_BTD[:, :n_valid].float().to(wave_BS.device)

    def loss(self, pred_BND: Tensor, targets_BND: Tensor) -> Tensor:
        """``1 - cos(pred, target)`` over the feature dimension, averaged over frames."""
        return (1.0 - F.cosine_similarity(pred_BND.float(), targets_BND.float(), dim=-1)).mean()

    def save(self, path: str | Path) -> Path:
        """Write ``teacher.json`` (kind, source, layer): the weights stay wherever ``source`` points."""
        body = {"version": TEACHER_VERSION, "kind": self.kind, "source": self.source, "layer": self.layer}
        return write_teacher_folder(Path(path), body, None)


# ---------------------------------------------------------------------- factory
def load_teacher(path: str | Path) -> SemanticTeacher:
    """A teacher saved by ``save``; a Whisper teacher is rebuilt from its recorded ``source``
    (safetensors only).

    The state file is checked against the sha256 manifest in ``teacher.json`` (a folder saved before
    manifests, without ``files``, loads unchecked).

    Raises:
        ValueError: one line naming the file (or Whisper source) and what is wrong with it.
    """
    path = Path(path)
    body = read_index(path, TEACHER_FILE, ValueError, "teacher")
    if body.get("version") != TEACHER_VERSION:
        raise ValueError(
            f"{path / TEACHER_FILE}: version {body.get('version')!r}, expected {TEACHER_VERSION!r}"
        )
    has_state = (path / STATE_FILE).is_file()
    verify_files(path, body, TEACHER_FILE, [STATE_FILE] if has_state else [], ValueError)
    state: dict[str, Tensor] = {}
    if has_state:
        try:
            state = load_file(path / STATE_FILE)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path / STATE_FILE}: unreadable ({str(e).splitlines()[0]})") from None
    if body.get("kind") == MFCCKMeansTeacher.kind:
        teacher = MFCCKMeansTeacher(body["n_clusters"], body["n_mfcc"], body["n_mels"])
        teacher._set_kmeans_state(state)
        return teacher
    if body.get("kind") == "content_kmeans":
        from ernie5.tokenizers.speech_content import load_content_teacher

        return load_content_teacher(path, body, state)
    if body.get("kind") == WhisperTeacher.kind:
        if not body.get("source"):
            raise ValueError(f"{path / TEACHER_FILE}: a Whisper teacher without a source cannot be reloaded")
        return WhisperTeacher.from_pretrained(body["source"], layer=int(body.get("layer", -1)))
    raise ValueError(f"{path / TEACHER_FILE}: unknown teacher kind {body.get('kind')!r}")


def build_teacher(
    kind: str, teacher_dim: int, whisper_source: str | None = None, content_encoder: str | None = None
) -> SemanticTeacher | None:
    """A fresh teacher for a codec config's ``teacher`` / ``teacher_dim`` (None for ``"none"``).

    ``mfcc_kmeans`` and ``content_kmeans`` (over the encoder folder ``content_encoder``) are returned
    unfitted (K = ``teacher_dim``); ``whisper`` loads ``whisper_source``
    and checks that its width equals ``teacher_dim``.
    """
    if kind == "none":
        return None
    if kind == "mfcc_kmeans":
        return MFCCKMeansTeacher(n_clusters=teacher_dim)
    if kind == "content_kmeans":
        if not content_encoder:
            raise ValueError(
                "teacher='content_kmeans' needs a trained speech-content encoder (content_encoder)"
            )
        from ernie5.tokenizers.speech_content import ContentKMeansTeacher, SpeechContentEncoder

        return ContentKMeansTeacher(SpeechContentEncoder.load(content_encoder), n_clusters=teacher_dim)
    if kind == "whisper":
        if not whisper_source:
            raise ValueError("teacher='whisper' needs a Whisper model id or folder (whisper_source)")
        teacher = WhisperTeacher.from_pretrained(whisper_source)
        if teacher.target_dim != teacher_dim:
            raise ValueError(
                f"teacher_dim={teacher_dim} must equal the Whisper encoder width {teacher.target_dim}"
            )
        return teacher
    raise ValueError(f"unknown teacher kind {kind!r}")
