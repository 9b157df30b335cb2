"""Speech rollouts for RL: Next-Codec-Prediction sampling that records each generated frame's behaviour
log-prob, and the learner's teacher-forced recomputation of those log-probs under the current weights.

:class:`AudioRolloutEngine` samples one utterance per rollout for a TTS prompt (``tts_dtmf``'s
``Dial: five star.``, ``tts_digits``' ``Say: seven three.`` with a speaker) exactly as the harness does
(:func:`ernie5.generation.audio.generate_audio`: the prompt ``BOS <prompt> BOA <start>`` with the
speaker's embedding at the start position, one KV-cache forward per frame in which the top ``Q`` kept
layers pick the ``Q`` codec levels in turn, END on level 1 ending the row, END barred before
``min_frames = 1`` frame, the task's frame budget), batched over every rollout it is handed (the ``G``
responses of a query and the other queries of the round). For every generated frame it stores

* ``tokens[j]``: the frame's ``Q`` codes packed into one integer (:func:`pack_frame`); a row that ended
  with END has one more token, END (:data:`END` packed: level-1 code ``end_code``),
* ``logp[j]``: its behaviour log-prob, the sum over the levels of ``log softmax(l_q / T)[c_q]`` (END: the
  level-1 log-prob of END alone; the levels drawn after END in the same forward are discarded),
* ``versions[j]``: the policy version,

so the utterance travels through the replay buffer, its checkpoints and the objectives like a text
response of ``n_frames (+1)`` tokens.

:func:`audio_logprobs` recomputes those log-probs with the forward the audio generation loss uses (the
prompt followed by the start position and the sampled frames as an ``AudioSeg`` with NCP targets, END as
the last target of a row that ended), in one packed batch, with gradient when enabled.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.3.2 (Next-Codec Prediction: a frame's levels from
    the top layers of one forward) and §4 (unified multimodal RL: one policy-gradient objective over every
    modality's outputs).
  * DnD-Transformer (arXiv 2410.01912): depth codes predicted by successive layers of one forward.

Deviations:
  1. The RL "token" of speech is one generated frame (``Q`` codes): its log-prob is the sum of its levels'
     log-probs (level ``q`` conditioned on the sampled levels ``< q`` through the code embeddings added
     between layers) and its entropy the sum of the levels' entropies along the sampled path. END is a
     token of its own (level 1 only). The objectives' token masks (IcePop) and sequence ratios act on
     frames, not on single codes.
  2. The harness samples speech with the TTS tasks' ``temperature = 0`` (argmax), which has no
     log-probs; the behaviour policy is ``softmax(l / T)`` over every code at
     ``rollout.audio_temperature`` (default 0.5, must be > 0) with no top-k (a top-k cut would make a
     code the learner's weights move out of the top k impossible: an infinite ratio). RL therefore
     trains the sampled distribution; the sweep after RL still scores the argmax utterance, so a gain
     shows only as far as the mode follows the distribution (a temperature below 1 keeps the trained
     distribution closer to its mode: on the reference, 0.5 moved the argmax scores more than 1.0).
  3. No routing replay for audio rows: the learner routes their positions afresh (the rollout's expert
     ids are not recorded), so the behaviour/learner mismatch of audio rows includes the MoE routing
     mismatch that MISC's token mask then handles.
  4. An utterance is generated whole in one engine round (the task's frame budget, whatever the round's
     token budget; ``rollout.max_new_tokens`` caps text responses only). Rollouts of one round are
     batched by frame budget (the harness batches its requests by ``max_frames`` too), each budget with
     its own generator seeded by ``(seed, round, budget index)``; within a batch the draws are
     ``generate_audio``'s for that seed.
  5. The sampler is ``generate_audio``'s own loop (:func:`ernie5.generation.audio.sample_frames`) with a
     draw (:func:`~ernie5.generation.audio.ncp_logits`, :func:`~ernie5.generation.audio.draw_codes`)
     that also keeps each code's log-prob; ``tests/train/rl/test_rollout_audio.py`` checks that both give
     the same codes for the same prompts and seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ernie5.data.audio_sources import speaker_id
from ernie5.generation.audio import AudioSampling, draw_codes, ncp_logits, sample_frames, speech_prompt
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.sequence import audio as audio_docs
from ernie5.sequence.segments import AudioSeg, Segment, pack, text_segment
from ernie5.tokenizers.special import BOS
from train.common.run_folder import RunError
from train.rl.buffer import OutputRollouts, Rollout

MIN_FRAMES = 1
"""END is barred before this many frames (``AudioSampling``'s default, what the harness samples with)."""


def speech_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """``BOS <prompt ids>``: the text of a TTS prompt, as the harness lays it out before ``BOA <start>``."""
    return [BOS, *tokenizer.encode(prompt)]


@dataclass
class AudioPrompt:
    """What the audio engine needs of a rollout's query."""

    ids: list[int]
    """``BOS <prompt>`` (:func:`speech_prompt_ids`)."""
    speaker: int
    """Speaker-embedding row (``-1``: the generic start)."""
    max_frames: int
    """The task's frame budget for the prompt (its ``SpeechGenerationRequest.max_frames``)."""

    def document(self, n_levels: int) -> list[Segment]:
        """``BOS <prompt> BOA <start>``: what generation starts from."""
        return speech_prompt([text_segment(list(self.ids))], n_levels, self.speaker)


def pack_frame(codes_Q: list[int], codebook_size: int) -> int:
    """A frame's ``Q`` codes as one integer, base ``codebook_size + 1`` (level 1 first, least significant);
    END (level-1 code ``codebook_size``, the model's ``end_code``) packs to ``codebook_size``."""
    base, out = codebook_size + 1, 0
    for c in reversed(codes_Q):
        out = out * base + int(c)
    return out


def unpack_frames(tokens: list[int], n_levels: int, codebook_size: int) -> tuple[torch.Tensor, bool]:
    """Inverse of :func:`pack_frame` over a rollout's tokens: the ``(n_frames, Q)`` codes and whether the
    last token is END (not among the frames)."""
    ended = bool(tokens) and tokens[-1] == codebook_size
    frames = tokens[:-1] if ended else tokens
    base = codebook_size + 1
    c = torch.tensor(frames, dtype=torch.long).view(-1, 1)
    codes = (c // base ** torch.arange(n_levels, dtype=torch.long)) % base
    return codes, ended


def decode_rollouts(codec, audio_cfg, rollouts: list[Rollout]) -> list[np.ndarray]:
    """The waveforms (float32, the codec's rate) of finished audio rollouts, as the harness decodes its
    sampled codes (``ernie5.sequence.audio.decode_codes``; no frames: an empty wave)."""
    codes = [unpack_frames(r.tokens, audio_cfg.n_levels, audio_cfg.codebook_size)[0] for r in rollouts]
    with torch.no_grad():
        return audio_docs.decode_codes(codec, codes)


class AudioRolloutEngine:
    """Samples one utterance per rollout from ``model`` (the policy's compute copy)."""

    def __init__(
        self,
        model,
        prompt_of: Callable[[Rollout], AudioPrompt],
        *,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        if model.audio is None:
            raise ValueError("speech rollouts need a model with an audio module")
        if not temperature > 0:
            raise ValueError(f"audio rollout temperature={temperature} must be > 0 (sampling)")
        self.model = model
        self.prompt_of = prompt_of
        self.temperature = temperature
        self.seed = seed

    @torch.inference_mode()
    def advance(
        self, rollouts: list[Rollout], budget: int, round_: int, subnet: Subnet, version: int
    ) -> tuple[int, int]:
        """Generate the utterance of every unfinished rollout (``budget`` is not used: an utterance is
        generated whole). Returns ``(decode_steps, tokens_sampled)``; each frame budget's rows are
        sampled with a generator seeded by ``(seed, round_)`` and the budget's index, in order."""
        rows = [r for r in rollouts if not r.done]
        if not rows:
            return 0, 0
        by_budget: dict[int, list[Rollout]] = {}
        for r in rows:
            by_budget.setdefault(self.prompt_of(r).max_frames, []).append(r)
        steps = tokens = 0
        k = self.model.cfg.audio.codebook_size
        for j, max_frames in enumerate(sorted(by_budget)):
            part = by_budget[max_frames]
            seed = hash((self.seed, round_, j, 104729)) % (1 << 62)  # ints only: stable across processes
            codes, ended, logp = self.sample(
                [self.prompt_of(r) for r in part], max_frames, seed=seed, subnet=subnet
            )
            for i, r in enumerate(part):
                r.tokens = [pack_frame(f.tolist(), k) for f in codes[i]] + ([k] if ended[i] else [])
                r.logp = logp[i]
                r.versions = [version] * len(r.tokens)
                r.done = True
                r.truncated = not ended[i]
                tokens += len(r.tokens)
            steps += max(len(lp) for lp in logp)
        return steps, tokens

    @torch.inference_mode()
    def sample(
        self, prompts: list[AudioPrompt], max_frames: int, *, seed: int, subnet: Subnet | None = None
    ) -> tuple[list[torch.Tensor], list[bool], list[list[float]]]:
        """``generate_audio``'s sampling at the engine's temperature (``AudioSampling(temperature,
        max_frames=max_frames, seed=seed)``), keeping the log-probs.

        Returns each row's ``(n_frames, Q)`` codes, whether it ended with END, and each of its tokens'
        behaviour log-prob (``n_frames`` frames, then END when it ended).
        """
        sampling = AudioSampling(
            temperature=self.temperature, min_frames=MIN_FRAMES, max_frames=max_frames, seed=seed
        )
        end_code = self.model.cfg.audio.end_code
        gen = torch.Generator(device="cpu").manual_seed(seed)
        q = self.model.cfg.audio.n_levels
        per_level: list[list[torch.Tensor]] = [[] for _ in range(q)]  # per level, per forward: (N,)

        def pick(level: int, logits_PK: torch.Tensor, n_done_P: torch.Tensor) -> torch.Tensor:
            logits = ncp_logits(level, logits_PK, n_done_P, sampling, end_code)  # generate_audio's draw
            codes = draw_codes(logits, sampling, gen)
            logp = torch.log_softmax(logits / self.temperature, dim=-1)
            per_level[level].append(logp.gather(-1, codes[:, None]).squeeze(-1).float().cpu())
            return codes

        docs = [p.document(q) for p in prompts]
        codes, ended = sample_frames(self.model, docs, max_frames, pick, subnet=subnet)
        lp_QNF = torch.stack([torch.stack(lv, dim=1) for lv in per_level])  # (Q, N, forwards)
        frame_NF = lp_QNF.sum(0)
        logps = []
        for i, c in enumerate(codes):
            n = len(c)
            row = frame_NF[i, :n].tolist()
            if ended[i]:
                row.append(float(lp_QNF[0, i, n]))
            logps.append(row)
        return codes, ended.tolist(), logps


@dataclass
class AudioLearnerBatch:
    """The teacher-forced forward over a set of audio rollouts (one row each)."""

    inputs: Inputs
    targets_PQ: torch.Tensor
    """Each prediction position's codes (level 1 of an END position: ``end_code``; -1: no target)."""
    frame_P: torch.Tensor
    """Each prediction position's frame index in its row (``j``: it predicts frame ``j + 1`` or END)."""
    counts: list[int]
    """Tokens (prediction positions) per row, in row order."""


def audio_learner_batch(rollouts: list[Rollout], prompts: list[AudioPrompt], audio_cfg) -> AudioLearnerBatch:
    """Pack ``BOS <prompt> BOA <start> <frames>`` per rollout with NCP targets (each position predicts the
    next frame, the last one END when the rollout ended)."""
    docs: list[list[Segment]] = []
    targets, frames, counts = [], [], []
    end_code = audio_cfg.end_code
    for r, p in zip(rollouts, prompts, strict=True):
        codes, ended = unpack_frames(r.tokens, audio_cfg.n_levels, audio_cfg.codebook_size)
        seg = AudioSeg(codes, start=True, speaker=p.speaker, targets=True, end=ended)
        docs.append([*p.document(audio_cfg.n_levels)[:-1], Segment("audio", audio=seg)])
        n = len(codes)
        tgt = torch.full((n + int(ended), audio_cfg.n_levels), -1, dtype=torch.long)
        tgt[:n] = codes
        if ended:
            tgt[n, 0] = end_code
        targets.append(tgt)
        frames.append(torch.arange(n + int(ended)))
        counts.append(n + int(ended))
    width = max(sum(len(s) for s in d) for d in docs)
    inputs = pack(docs, width, n_rows=len(docs), one_per_row=True).inputs
    return AudioLearnerBatch(inputs, torch.cat(targets), torch.cat(frames), counts)


def audio_logprobs(model, batch: AudioLearnerBatch, subnet: Subnet, temperature: float, end_code: int):
    """Per generated token (frame or END): its log-prob under the policy at ``temperature``, with grad when
    enabled, and its entropy (detached), summed over the levels it holds: ``((B, T), (B, T))``, zero past
    a row's tokens."""
    out = model(batch.inputs, subnet=subnet, return_logits=False)
    tgt_PQ = batch.targets_PQ.to(out.audio_logits[0].device)
    frame_P = batch.frame_P.to(tgt_PQ.device)
    sampling = AudioSampling(temperature=temperature, min_frames=MIN_FRAMES)
    logp_P = ent_P = 0
    for level, logits_PK in enumerate(out.audio_logits):
        z = ncp_logits(level, logits_PK, frame_P, sampling, end_code)  # the sampler's own logits
        lp_PK = torch.log_softmax(z / temperature, dim=-1)
        tgt = tgt_PQ[:, level]
        valid = tgt >= 0
        lp = lp_PK.gather(-1, tgt.clamp_min(0)[:, None]).squeeze(-1)
        p_PK = lp_PK.exp()
        ent = -(p_PK * lp_PK.masked_fill(p_PK == 0, 0.0)).sum(-1)
        logp_P = logp_P + torch.where(valid, lp, torch.zeros_like(lp))
        ent_P = ent_P + torch.where(valid, ent, torch.zeros_like(ent))
    b, t = len(batch.counts), max(batch.counts)
    mask = torch.arange(t)[None, :] < torch.tensor(batch.counts)[:, None]
    logp_BT = logp_P.new_zeros(b, t).masked_scatter(mask.to(logp_P.device), logp_P)
    ent_BT = ent_P.new_zeros(b, t).masked_scatter(mask.to(ent_P.device), ent_P)
    return logp_BT, ent_BT.detach()


class AudioRollouts(OutputRollouts):
    """Speech answers of the RL loop (queries whose ``output`` is ``"audio"``): each query's prompt, the
    engine that samples them, their decoded waveforms (what the judge scores), and the learner's
    batches and log-probs."""

    def __init__(
        self,
        model,
        tokenizer,
        codec,
        audio_cfg,
        query_of: Callable[[int], Any],
        *,
        temperature: float,
        seed: int,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.codec = codec
        self.audio_cfg = audio_cfg
        super().__init__(query_of)
        self.temperature = temperature
        self.engine = AudioRolloutEngine(model, self.prompt, temperature=temperature, seed=seed)

    def make_prompt(self, query: Any) -> AudioPrompt:
        """``BOS <prompt>``, the speaker row and the frame budget; a speaker the model has no embedding
        row for is a :class:`RunError`."""
        name = getattr(query, "speaker", "")
        spk = speaker_id(name) if name else -1
        n_spk = self.audio_cfg.n_speakers
        if name and not 0 <= spk < n_spk:
            raise RunError(
                f"rl query {query.id}: speaker {name!r} is not one this model knows "
                f"({n_spk} speaker-embedding rows)"
            )
        return AudioPrompt(speech_prompt_ids(self.tokenizer, query.context), spk, query.max_new_tokens)

    def answers(self, rows: list[Rollout]) -> list[np.ndarray]:
        """The decoded waveforms of finished rollouts (:func:`decode_rollouts`)."""
        return decode_rollouts(self.codec, self.audio_cfg, rows)

    def learner_batch(self, rows: list[Rollout], replay: bool) -> AudioLearnerBatch:
        """The learner's batch (:func:`audio_learner_batch`; no routing replay for speech)."""
        return audio_learner_batch(rows, [self.prompt(r) for r in rows], self.audio_cfg)

    def logprobs(
        self, batch: AudioLearnerBatch, subnet: Subnet, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per generated frame (and END): log-prob and entropy summed over its levels
        (:func:`audio_logprobs`); under ``model`` instead of the policy when given."""
        return audio_logprobs(model or self.model, batch, subnet, self.temperature, self.audio_cfg.end_code)
