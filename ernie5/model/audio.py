"""Audio inside the backbone: summed codec-level input embeddings and Next-Codec Prediction heads.

Input (report §2.3.2): one position per codec frame; its embedding is the sum over RVQ levels of
level-specific embedding tables, ``e = sum_q E_q[c_q]``. An audio segment that is generated starts
with one conditioning position: a learned speaker embedding (TTS) or a learned generic start.

Generation, Next-Codec Prediction (NCP; DnD-Transformer style): the hidden state of position ``t``
predicts the codes of frame ``t + 1`` level by level inside one forward pass. The head of level
``q`` reads the output of the ``q``-th of the top ``Q`` kept layers; the embedding of that level's
code (the ground truth under teacher forcing, the sampled code at inference) is then added to the
hidden state of position ``t`` before the next layer, so level ``q + 1`` is conditioned on levels
``1..q`` with no depth transformer and no longer sequence. Causality holds: position ``t`` only
receives the codes of frame ``t + 1``, which every later position already sees as input. Level 1
(the semantic level) has one extra code, END, predicted after the last frame.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.3 (codec tokens, summed level embeddings,
    audio heads in the top layers, speaker embedding in the TTS context), Fig. 3.
  * DnD-Transformer (arXiv 2410.01912): depth codes predicted by successive layers of one forward.

Deviations:
  1. The heads sit on the top ``Q`` *kept* layers of the running subnet (not fixed layer indices),
     so every elastic depth can speak; a subnet with fewer than ``Q`` layers stacks its first
     levels on its first kept layer (code embeddings are still added between heads). The report
     does not say how NCP interacts with elastic depth.
  2. The end of an audio segment is an extra level-1 code (END) rather than a text token, so the
     model decides when to stop from the same head that starts each frame (undisclosed in the
     report).
  3. The code embeddings added between layers are tables of their own, separate from the input
     tables (the report does not say whether they are shared).
  4. Speakers are a learned table indexed by speaker id (the report's speaker embedding is not
     described further); ``-1`` selects a generic start embedding.
  5. Optional (``AudioConfig.content_dim > 0``, the shipped reference's setting since v4): an
     understanding frame's embedding is the summed code embeddings *plus* a learned two-layer projection
     (no biases, so absent features add exactly 0) of a frozen speech-content encoder's features of the
     frame. Measured on FSDD's held-out speaker with a small classifier on each representation: the
     codec's codes name the spoken digit 0.37-0.40 of the time (the ideal level-1 content units 0.52),
     log-mel frames 0.81-0.84. Discrete 25 Hz codes lose what makes speech intelligible across voices
     at this scale, so understanding also reads continuous features, as the vision path reads the
     tokenizer's features through a ViT. Generation (NCP) is unchanged and never sees them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ernie5.model.config import AudioConfig
from ernie5.model.inputs import AudioInputs

END_TARGET = -2
"""Level-1 target of the position after a segment's last frame: END (the model's ``end_code``)."""


class AudioModule(nn.Module):
    """Input embeddings, start/speaker embeddings, per-level heads and between-layer code embeddings."""

    def __init__(self, cfg: AudioConfig, d_model: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        q, k = cfg.n_levels, cfg.codebook_size
        self.in_emb = nn.ModuleList(nn.Embedding(k, d_model) for _ in range(q))
        self.start_emb = nn.Parameter(torch.zeros(d_model))
        self.speaker_emb = nn.Embedding(cfg.n_speakers, d_model)
        self.head_norm = nn.ModuleList(nn.RMSNorm(d_model, eps=norm_eps) for _ in range(q))
        self.heads = nn.ModuleList(nn.Linear(d_model, k + (1 if i == 0 else 0), bias=False) for i in range(q))
        # Level-1 codes include END; the last level's code is never added (nothing follows it).
        self.code_emb = nn.ModuleList(nn.Embedding(k + (1 if i == 0 else 0), d_model) for i in range(q - 1))
        self.content_proj = None
        if cfg.content_dim > 0:  # bias-free: a frame without features (all zeros) gets exactly 0
            self.content_proj = nn.Sequential(
                nn.Linear(cfg.content_dim, d_model, bias=False),
                nn.GELU(),
                nn.Linear(d_model, d_model, bias=False),
            )

    def frame_embeds(self, codes_NQ: torch.Tensor, feats_NF: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, D)``: the sum over levels of each frame's level embeddings, plus the projection of its
        content features when the model has one and ``feats_NF`` is given (deviation 5)."""
        e = sum(self.in_emb[q](codes_NQ[:, q]) for q in range(self.cfg.n_levels))
        if self.content_proj is not None and feats_NF is not None:
            w = self.content_proj[0].weight
            e = e + self.content_proj(feats_NF.to(w.dtype)).to(e.dtype)
        return e

    def start_embeds(self, speaker_S: torch.Tensor) -> torch.Tensor:
        """``(S, D)``: the speaker's embedding, or the generic start where the id is ``-1``."""
        spk = self.speaker_emb(speaker_S.clamp_min(0))
        return torch.where((speaker_S >= 0)[:, None], spk, self.start_emb.to(spk.dtype).expand_as(spk))

    def logits(self, level: int, h_PD: torch.Tensor) -> torch.Tensor:
        """``(P, K[+1])`` logits of ``level`` (0-based) from hidden states."""
        return self.heads[level](self.head_norm[level](h_PD))

    def add_code(self, level: int, h_PD: torch.Tensor, codes_P: torch.Tensor) -> torch.Tensor:
        """``h + Emb_level(code)``; rows whose code is negative (no target) are left unchanged."""
        emb = self.code_emb[level](codes_P.clamp_min(0)).to(h_PD.dtype)
        return h_PD + emb * (codes_P >= 0)[:, None].to(h_PD.dtype)

    def embed(self, x_BTD: torch.Tensor, audio: AudioInputs) -> torch.Tensor:
        """``x`` with the summed codec frames and the start/speaker embeddings placed where their
        masks say."""
        if audio.frame_codes_MQ is not None:
            frames_MD = self.frame_embeds(audio.frame_codes_MQ, audio.frame_feats_MF)
            x_BTD = x_BTD.masked_scatter(audio.frame_mask_BT[..., None], frames_MD.to(x_BTD.dtype))
        if audio.start_speaker_S is not None:
            starts_SD = self.start_embeds(audio.start_speaker_S)
            x_BTD = x_BTD.masked_scatter(audio.start_mask_BT[..., None], starts_SD.to(x_BTD.dtype))
        return x_BTD

    def level_layers(self, kept_layers: Sequence[int]) -> dict[int, list[int]]:
        """Layer index -> the levels whose heads read that layer's output: level ``q`` on the
        ``(L - Q + q)``-th of the ``L`` kept layers; with fewer than ``Q`` kept layers the first
        levels stack on the first one (deviation 1)."""
        q, kept = self.cfg.n_levels, list(kept_layers)
        plan: dict[int, list[int]] = {}
        for level in range(q):
            plan.setdefault(kept[max(0, len(kept) - q + level)], []).append(level)
        return plan

    def predict_level(
        self,
        level: int,
        x_BTD: torch.Tensor,
        audio: AudioInputs,
        sampler: Callable[[int, torch.Tensor], torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One NCP level at the prediction positions: its logits, its codes (the targets under
        teacher forcing, else ``sampler(level, logits)``), its mean cross-entropy (None without
        targets), and ``x`` with the codes' embeddings added for the next level's head.

        Returns:
            ``(x_BTD, logits_PK, codes_P, loss)``; codes are ``-1`` where a position has no target.
        """
        mask_BT = audio.pred_mask_BT
        h_PD = x_BTD[mask_BT]
        logits_PK = self.logits(level, h_PD).float()
        loss = None
        if audio.targets_PQ is not None:
            tgt_P = audio.targets_PQ[:, level]
            if level == 0:
                tgt_P = torch.where(tgt_P == END_TARGET, torch.full_like(tgt_P, self.cfg.end_code), tgt_P)
            valid_P = tgt_P >= 0
            ce_P = F.cross_entropy(logits_PK, tgt_P.clamp_min(0), reduction="none")
            loss = (ce_P * valid_P).sum() / valid_P.sum().clamp_min(1)
            codes_P = torch.where(valid_P, tgt_P, torch.full_like(tgt_P, -1))
        else:
            codes_P = sampler(level, logits_PK).long()
        if level < self.cfg.n_levels - 1:
            x_BTD = x_BTD.masked_scatter(mask_BT[..., None], self.add_code(level, h_PD, codes_P))
        return x_BTD, logits_PK, codes_P, loss

    def loss(self, level_losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """The NCP loss: the levels' losses averaged with ``level_weights`` (default equal)."""
        w = self.cfg.level_weights or (1.0,) * self.cfg.n_levels
        return sum(wq * lq for wq, lq in zip(w, level_losses, strict=True)) / sum(w)
