"""Image rollouts for RL: NFSP sampling that records each generated token's behaviour log-prob, and the
learner's teacher-forced recomputation of those log-probs under the current weights.

:class:`ImageRolloutEngine` samples one image per rollout for a text-to-image prompt exactly as the
harness does (:func:`ernie5.generation.vision.generate_media`: per scale, coarsest first, one KV-cache
forward over the scale's block, classifier-free guidance ``l = l_u + s (l_c - l_u)`` with an
unconditional ``BOS BOI`` row beside every conditional row, bits drawn from ``sigmoid(l / T)`` with the
same generator calls), batched over every rollout it is handed (the ``G`` responses of a query and the
other queries of the round). For every generated position (one image token: ``D`` bits) it stores

* ``tokens[j]``: the token's bits packed into one integer (bit ``d`` set when the sampled bit is ``+1``),
* ``logp[j]``: its behaviour log-prob ``sum_d log sigmoid(b_d l_d / T)`` under the guided logits,
* ``versions[j]``: the policy version,

so the image travels through the replay buffer, its checkpoints and the objectives like a text response
of ``tokens_per_frame`` tokens.

:func:`image_logprobs` recomputes those log-probs with the model forward the vision generation loss uses
(``BOS <prompt> BOI`` followed by the image's NFSP generation segment, teacher-forced with the sampled
bits as the VAR inputs; the unconditional row ``BOS BOI`` + the same segment when guided), in one packed
batch, with gradient when enabled.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.2.3 (NFSP) and §4 (unified multimodal RL: one
    policy-gradient objective over every modality's outputs).
  * VAR (arXiv 2404.02905), Infinity (arXiv 2412.04431): bitwise multi-scale sampling with CFG.

Deviations:
  1. The RL "token" of an image is one generated position (a ``D``-bit code): its log-prob is the sum
     of its bits' log-probs (the bits of a position are independent given the logits), and its entropy
     the sum of the bits' Bernoulli entropies. The objectives' token masks (IcePop) and sequence ratios
     act on positions, not on single bits.
  2. The policy is the *guided* distribution the harness samples from (``cfg_scale`` of the task,
     ``3.0``), so its gradient reaches the unconditional row too; ``cfg_scale = 1`` trains the
     conditional model alone.
  3. No routing replay for image rows: the learner routes their positions afresh (the rollout's expert
     ids are not recorded), so the behaviour/learner mismatch of image rows includes the MoE routing
     mismatch that MISC's token mask then handles.
  4. Images only (one frame): text-to-video prompts are not rolled out. An image is generated whole in
     one engine round, whatever the round's token budget (a scale is one block; the scheduler's chunking
     applies to text responses).
  5. The sampler is ``generate_media``'s own loop (``ernie5.generation.vision.sample_scales``) with a
     draw that also keeps each position's log-prob; ``tests/train/rl/test_rollout_image.py`` checks that
     both give the same pixels for the same prompts and seed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ernie5.generation.vision import sample_scales
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.sequence.segments import Segment, pack, text_segment
from ernie5.sequence.vision import generation_segment, prompt_ids, to_uint8
from ernie5.tokenizers.special import BOI, BOS
from train.rl.buffer import OutputRollouts, Rollout


def image_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """``BOS <prompt ids> BOI``: the conditional row of a text-to-image prompt, as the harness lays it out."""
    return [BOS, *prompt_ids(tokenizer, prompt), BOI]


UNCOND_IDS = (BOS, BOI)
"""The unconditional (guidance) row's prompt."""


@dataclass
class ImagePrompt:
    """What the image engine needs of a rollout's query."""

    ids: list[int]
    """``BOS <prompt> BOI``."""
    cfg_scale: float


def pack_codes(bits_PD: torch.Tensor) -> list[int]:
    """``(P, D)`` bits in {-1, +1} -> one integer per position (bit ``d`` set where the bit is +1)."""
    weights = 1 << torch.arange(bits_PD.shape[-1], dtype=torch.long)
    return ((bits_PD > 0).long() * weights).sum(-1).tolist()


def unpack_codes(codes: list[int], n_bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``(P, D)`` float bits in {-1, +1}."""
    c = torch.tensor(codes, dtype=torch.long)[:, None]
    on = (c >> torch.arange(n_bits, dtype=torch.long)) & 1
    return on.float() * 2 - 1


def scale_bits(vision_cfg, bits_NPD: torch.Tensor) -> list[torch.Tensor]:
    """``(N, P, D)`` bits of one-frame images -> per scale ``(N, 1, s, s, D)`` (the tokenizer's layout)."""
    out, at = [], 0
    for s in vision_cfg.scales:
        out.append(bits_NPD[:, at : at + s * s].reshape(bits_NPD.shape[0], 1, s, s, -1))
        at += s * s
    return out


def bit_logprobs(logits_BPD: torch.Tensor, bits_BPD: torch.Tensor, temperature: float):
    """Per position: the log-prob of its sampled bits and the entropy of its bit distribution, both summed
    over the bits, at ``temperature``: ``((B, P), (B, P))``."""
    z = logits_BPD.float() / temperature
    logp = F.logsigmoid(bits_BPD * z).sum(-1)
    p = torch.sigmoid(z)
    ent = (F.softplus(z) - p * z).sum(-1)  # Bernoulli entropy: -p log p - (1-p) log(1-p)
    return logp, ent


def decode_rollouts(vision_tokenizer, vision_cfg, rollouts: list[Rollout]) -> np.ndarray:
    """The images of finished image rollouts: uint8 ``(N, 1, H, W, 3)``."""
    bits = torch.stack([unpack_codes(r.tokens, vision_cfg.latent_bits) for r in rollouts])
    with torch.no_grad():
        pixels = vision_tokenizer.decode(vision_tokenizer.codes_to_fhat(scale_bits(vision_cfg, bits)))
    return to_uint8(pixels)


class ImageRolloutEngine:
    """Samples one image per rollout from ``model`` (the policy's compute copy)."""

    def __init__(
        self,
        model,
        vision_tokenizer,
        prompt_of: Callable[[Rollout], ImagePrompt],
        *,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        if model.vision is None or vision_tokenizer is None:
            raise ValueError("image rollouts need a model with a vision module and a vision tokenizer")
        self.model = model
        self.vision_tokenizer = vision_tokenizer
        self.prompt_of = prompt_of
        self.temperature = temperature
        self.seed = seed

    @torch.inference_mode()
    def advance(
        self, rollouts: list[Rollout], budget: int, round_: int, subnet: Subnet, version: int
    ) -> tuple[int, int]:
        """Generate the image of every unfinished rollout (``budget`` is not used: an image is generated
        whole). Returns ``(decode_steps, tokens_sampled)``; the draws come from a generator seeded by
        ``(seed, round_)`` and each guidance scale's rows, in order."""
        rows = [r for r in rollouts if not r.done]
        if not rows:
            return 0, 0
        by_scale: dict[float, list[Rollout]] = {}
        for r in rows:
            by_scale.setdefault(self.prompt_of(r).cfg_scale, []).append(r)
        steps = tokens = 0
        for j, scale in enumerate(sorted(by_scale)):
            part = by_scale[scale]
            seed = hash((self.seed, round_, j, 7919)) % (1 << 62)  # ints only: stable across processes
            bits_NPD, logp_NP = self.sample(
                [self.prompt_of(r).ids for r in part], scale, seed=seed, subnet=subnet
            )
            for k, r in enumerate(part):
                r.tokens = pack_codes(bits_NPD[k])
                r.logp = logp_NP[k].tolist()
                r.versions = [version] * len(r.tokens)
                r.done = True
            steps += len(self.model.cfg.vision.scales)
            tokens += logp_NP.numel()
        return steps, tokens

    @torch.inference_mode()
    def sample(
        self, prompts: list[list[int]], cfg_scale: float, *, seed: int, subnet: Subnet | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``generate_media``'s sampling loop for one-frame images: ``prompts`` end with BOI.

        Returns the sampled bits ``(N, P, D)`` in {-1, +1} and each position's behaviour log-prob
        ``(N, P)`` (guided logits at the engine's temperature).
        """
        guided = cfg_scale != 1.0
        rows_prompts = list(prompts) + ([list(UNCOND_IDS)] * len(prompts) if guided else [])
        n, d = len(prompts), self.model.cfg.vision.latent_bits
        gen = torch.Generator(device="cpu").manual_seed(seed)
        logps: list[torch.Tensor] = []

        def pick(logits: torch.Tensor) -> torch.Tensor:  # generate_media's draw, log-prob kept
            p = torch.sigmoid(logits / self.temperature)
            bits = torch.where(torch.rand(p.shape, generator=gen) < p, 1.0, -1.0)
            logps.append(bit_logprobs(logits, bits, self.temperature)[0])
            return bits

        vt = self.vision_tokenizer
        (bits_f,) = sample_scales(  # one frame
            self.model, vt, rows_prompts, n, 1, cfg_scale=cfg_scale, subnet=subnet, pick=pick
        )
        return torch.cat([b.reshape(n, -1, d) for b in bits_f], dim=1), torch.cat(logps, dim=1)


@dataclass
class ImageLearnerBatch:
    """The teacher-forced forward over a set of image rollouts (conditional rows, then unconditional)."""

    inputs: Inputs
    bits_BPD: torch.Tensor
    """The sampled bits in {-1, +1}."""
    cfg_scale: float


def image_learner_batch(rollouts: list[Rollout], prompts: list[ImagePrompt], vision_tokenizer, vision_cfg):
    """Pack ``BOS <prompt> BOI <generation segment>`` per rollout (and ``BOS BOI <segment>`` per rollout
    when guided), the sampled bits as the VAR inputs; every rollout of a batch shares one ``cfg_scale``."""
    scales = {p.cfg_scale for p in prompts}
    if len(scales) != 1:
        raise ValueError(f"one learner batch needs one cfg_scale, got {sorted(scales)}")
    (scale,) = scales
    bits = torch.stack([unpack_codes(r.tokens, vision_cfg.latent_bits) for r in rollouts])
    per_scale = scale_bits(vision_cfg, bits)
    docs: list[list[Segment]] = []
    segs = []
    for i in range(len(rollouts)):
        input_bits = [b[i] for b in per_scale]  # (1, s, s, D) per scale
        segs.append(generation_segment(vision_tokenizer, vision_cfg, None, input_bits))
    for p, seg in zip(prompts, segs, strict=True):
        docs.append([text_segment(list(p.ids)), seg])
    if scale != 1.0:
        docs += [[text_segment(list(UNCOND_IDS)), seg] for seg in segs]
    width = max(sum(len(s) for s in d) for d in docs)
    inputs = pack(docs, width, n_rows=len(docs), one_per_row=True).inputs
    return ImageLearnerBatch(inputs, bits, scale)


def image_logprobs(model, batch: ImageLearnerBatch, subnet: Subnet, temperature: float):
    """Per generated position: log-prob of the sampled bits under the (guided) policy, with grad when
    enabled, and the entropy of its bit distribution (detached): ``((B, P), (B, P))``."""
    out = model(batch.inputs, subnet=subnet, return_logits=False)
    b, p, d = batch.bits_BPD.shape
    logits = out.bit_logits_PD.float().view(-1, p, d)
    if batch.cfg_scale != 1.0:
        logits = logits[b:] + batch.cfg_scale * (logits[:b] - logits[b:])
    logp, ent = bit_logprobs(logits, batch.bits_BPD.to(logits.device), temperature)
    return logp, ent.detach()


class ImageRollouts(OutputRollouts):
    """Image answers of the RL loop (queries whose ``output`` is ``"image"``): each query's prompt, the
    engine that samples them, their decoded images (what the judge scores), and the learner's batches
    and log-probs."""

    def __init__(
        self,
        model,
        tokenizer,
        vision_tokenizer,
        vision_cfg,
        query_of: Callable[[int], Any],
        *,
        cfg_scale: float,
        temperature: float,
        seed: int,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.vision_tokenizer = vision_tokenizer
        self.vision_cfg = vision_cfg
        super().__init__(query_of)
        self.cfg_scale = cfg_scale
        """Guidance scale (< 0: each query's own)."""
        self.temperature = temperature
        self.engine = ImageRolloutEngine(
            model, vision_tokenizer, self.prompt, temperature=temperature, seed=seed
        )

    def make_prompt(self, query: Any) -> ImagePrompt:
        """``BOS <prompt> BOI`` and the guidance scale (the query's own unless ``cfg_scale`` >= 0)."""
        scale = query.cfg_scale if self.cfg_scale < 0 else self.cfg_scale
        return ImagePrompt(image_prompt_ids(self.tokenizer, query.context), scale)

    def answers(self, rows: list[Rollout]) -> np.ndarray:
        """The decoded images of finished rollouts (:func:`decode_rollouts`)."""
        return decode_rollouts(self.vision_tokenizer, self.vision_cfg, rows)

    def learner_batch(self, rows: list[Rollout], replay: bool) -> ImageLearnerBatch:
        """The learner's batch (:func:`image_learner_batch`; no routing replay for images)."""
        prompts = [self.prompt(r) for r in rows]
        return image_learner_batch(rows, prompts, self.vision_tokenizer, self.vision_cfg)

    def logprobs(
        self, batch: ImageLearnerBatch, subnet: Subnet, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per generated position: log-prob and entropy summed over its bits (:func:`image_logprobs`);
        under ``model`` instead of the policy when given."""
        return image_logprobs(model or self.model, batch, subnet, self.temperature)
