"""K-means cluster-id targets for the audio codec's level-1 distillation, and the teacher folder format.

The base of the MFCC teacher (:mod:`ernie5.tokenizers.audio_teacher`) and of the content teacher
(:mod:`ernie5.tokenizers.speech_content`): features pooled to the codec's frames are standardised and
assigned to the nearest of K centroids fitted (seeded) on training frames, and the codec's semantic
head is trained with cross-entropy against the cluster ids (HuBERT's targets).

References:
  * HuBERT, Hsu et al. 2021, arXiv 2106.07447: k-means cluster ids as masked-prediction targets.

Deviations:
  1. None beyond the teachers' own (see their modules).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor

from ernie5.tokenizers.audio_quant import kmeans, nearest
from ernie5.tokenizers.folder import write_folder_atomic

TEACHER_FILE = "teacher.json"
STATE_FILE = "teacher.safetensors"
TEACHER_VERSION = "ernie5-audio-teacher/1"


def write_teacher_folder(path: Path, body: dict[str, Any], tensors: dict[str, Tensor] | None) -> Path:
    """The folder ``path``: ``teacher.json`` (``body`` + the sha256 manifest, written last) and the state
    tensors, published atomically (:func:`~ernie5.tokenizers.folder.write_folder_atomic`)."""

    def write(tmp: Path) -> None:
        if tensors:
            save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp / STATE_FILE)

    return write_folder_atomic(path, write, body, index_file=TEACHER_FILE)


# ---------------------------------------------------------------------- k-means targets
class KMeansTeacher:
    """Cluster-id targets of pooled teacher features (HuBERT-style): the standardisation and k-means
    centroids are fitted on training frames; the loss is the cross-entropy of the codec's semantic head.

    Subclasses give :meth:`features` and :attr:`feature_dim`; unfitted, a teacher only computes features.
    """

    kind = ""

    def __init__(self, n_clusters: int) -> None:
        if n_clusters < 2:
            raise ValueError(f"need n_clusters >= 2, got {n_clusters}")
        self.n_clusters = n_clusters
        self.mean_D: Tensor | None = None
        self.std_D: Tensor | None = None
        self.centroids_KD: Tensor | None = None

    @property
    def feature_dim(self) -> int:
        """Dimensions of one feature frame."""
        raise NotImplementedError

    def features(self, wave_BS: Tensor, sample_rate: int) -> Tensor:
        """Frame features ``(B, T, feature_dim)``."""
        raise NotImplementedError

    @property
    def target_dim(self) -> int:
        """K: the semantic head outputs one logit per cluster."""
        return self.n_clusters

    @property
    def fitted(self) -> bool:
        """Whether :meth:`fit` (or :func:`load_teacher`) has set the centroids."""
        return self.centroids_KD is not None

    def fit(self, feats_MD: Tensor, seed: int = 0, iters: int = 50) -> KMeansTeacher:
        """Fit the standardisation and k-means centroids on pooled feature frames ``(M, feature_dim)``
        (``M >= n_clusters``); deterministic given ``seed``. Returns self."""
        if feats_MD.ndim != 2 or feats_MD.shape[1] != self.feature_dim:
            raise ValueError(f"fit needs (M, {self.feature_dim}) features, got {tuple(feats_MD.shape)}")
        if feats_MD.shape[0] < self.n_clusters:
            raise ValueError(
                f"fit needs at least n_clusters={self.n_clusters} frames, got {feats_MD.shape[0]}"
            )
        x = feats_MD.detach().double()
        self.mean_D = x.mean(0).float()
        self.std_D = x.std(0).clamp_min(1e-6).float()
        gen = torch.Generator().manual_seed(seed)
        self.centroids_KD, _ = kmeans(self._standardise(feats_MD), self.n_clusters, iters, generator=gen)
        return self

    def _standardise(self, feats: Tensor) -> Tensor:
        return (feats.float() - self.mean_D.to(feats.device)) / self.std_D.to(feats.device)

    @torch.no_grad()
    def assign(self, feats_BND: Tensor) -> Tensor:
        """Cluster id (long ``(B, N)``) of every pooled feature frame."""
        if not self.fitted:
            raise ValueError(f"{type(self).__name__} is not fitted (call fit or load_teacher)")
        B, N, D = feats_BND.shape
        x = self._standardise(feats_BND.reshape(B * N, D))
        return nearest(x, self.centroids_KD.to(x.device)).reshape(B, N)

    def loss(self, pred_BNK: Tensor, targets_BND: Tensor) -> Tensor:
        """Cross-entropy of the head's logits ``(B, N, K)`` against the cluster ids of the pooled features."""
        ids = self.assign(targets_BND)
        return F.cross_entropy(pred_BNK.reshape(-1, pred_BNK.shape[-1]).float(), ids.reshape(-1))

    @torch.no_grad()
    def accuracy(self, pred_BNK: Tensor, targets_BND: Tensor) -> float:
        """Share of frames whose arg-max logit is their cluster id."""
        return float((pred_BNK.argmax(-1) == self.assign(targets_BND)).float().mean())

    def _kmeans_state(self) -> dict[str, Tensor]:
        if not self.fitted:
            return {}
        return {"mean": self.mean_D, "std": self.std_D, "centroids": self.centroids_KD}

    def _set_kmeans_state(self, state: dict[str, Tensor]) -> None:
        if "centroids" in state:
            self.mean_D, self.std_D, self.centroids_KD = state["mean"], state["std"], state["centroids"]
