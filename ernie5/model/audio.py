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
"""

from __future__ import annotations

import torch
from torch import nn

from ernie5.model.config import AudioConfig
from ernie5.model.norm import RMSNorm


class AudioModule(nn.Module):
    """Input embeddings, start/speaker embeddings, per-level heads and between-layer code embeddings."""

    def __init__(self, cfg: AudioConfig, d_model: int, norm_eps: float = 1e-6) -> None:
        super().__init__()
        self.cfg = cfg
        q, k = cfg.n_levels, cfg.codebook_size
        self.in_emb = nn.ModuleList(nn.Embedding(k, d_model) for _ in range(q))
        self.start_emb = nn.Parameter(torch.zeros(d_model))
        self.speaker_emb = nn.Embedding(cfg.n_speakers, d_model)
        self.head_norm = nn.ModuleList(RMSNorm(d_model, eps=norm_eps) for _ in range(q))
        self.heads = nn.ModuleList(nn.Linear(d_model, k + (1 if i == 0 else 0), bias=False) for i in range(q))
        # Level-1 codes include END; the last level's code is never added (nothing follows it).
        self.code_emb = nn.ModuleList(nn.Embedding(k + (1 if i == 0 else 0), d_model) for i in range(q - 1))

    def frame_embeds(self, codes_NQ: torch.Tensor) -> torch.Tensor:
        """``(N, D)``: the sum over levels of each frame's level embeddings."""
        return sum(self.in_emb[q](codes_NQ[:, q]) for q in range(self.cfg.n_levels))

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
