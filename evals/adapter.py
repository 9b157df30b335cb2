"""One sub-model of an ERNIE5 checkpoint as an :class:`~evals.api.EvalModel`.

An :class:`Ernie5EvalModel` is bound to one checkpoint and one concrete sub-model for its whole
life; a sweep makes one per sub-model over the same loaded supernet (the forward takes the subnet
as an argument, so nothing is copied or re-loaded). Every method returns :class:`~evals.api.Answers`:
the results, each request's share of its batch's wall time and token counts, the seconds spent in
model forwards and the expert loads of the real tokens. The adapter keeps no state between calls.

Tokenisation follows lm-eval's conventions: every sequence starts with BOS; a loglikelihood
continuation is the token difference between ``encode(context + continuation)`` and
``encode(context)`` (falling back to encoding the continuation alone when BPE merges across the
boundary); contexts longer than the model's window are cut from the left. Rolling loglikelihood
scores a document in windows of ``max_seq_len`` tokens with a stride of half a window, so every
token after the first window is predicted with at least half a window of left context.

Over 500 lines for one reason: one class, whose seven request kinds share its batching, padding,
media encoding and tallies over one bound sub-model.

Batches: requests are sorted by length and scored ``batch_size`` at a time (right padding for
scoring, left padding for generation), then returned in the original order. Log-likelihood requests
that share a context (the choices of one question) share its forward: one forward for one-token
choices, the context's KV cache continued for longer ones (:mod:`evals.shared_context`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable

import numpy as np
import torch

from ernie5.data.audio_sources import speaker_id
from ernie5.generation.audio import AudioSampling, generate_audio, speech_prompt
from ernie5.generation.text import cut_at_stop, generate
from ernie5.generation.vision import generate_media
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.model.model import ModelOutput
from ernie5.sequence import audio as audio_docs
from ernie5.sequence.context import ContextError, context_document, media_segments, media_segments_many
from ernie5.sequence.segments import text_segment
from ernie5.sequence.vision import (
    prompt_ids,
    to_pixels,
    to_uint8,
)
from ernie5.store.checkpoint import Checkpoint, checkpoint_hash
from ernie5.tokenizers.special import BOS, PAD
from evals.api import (
    Answers,
    Context,
    Cost,
    GenerationRequest,
    GenerationResult,
    LoglikelihoodRequest,
    LoglikelihoodResult,
    MediaGenerationRequest,
    MediaPart,
    MediaResult,
    ReconstructionRequest,
    RefineRequest,
    RollingRequest,
    RollingResult,
    SpeechGenerationRequest,
)
from evals.shared_context import Choice, rolling_windows, score_choices, score_each

ADAPTER_VERSION = 1
"""Bumped when tokenisation or scoring conventions change (it is part of the fingerprint)."""


class EvalInputError(ValueError):
    """A request this model cannot take (e.g. an image for a text-only checkpoint)."""


class _Tally:
    """What one call to the adapter spent: seconds inside model forwards and the expert loads of
    the real (non-padding) tokens; made per call, returned with its answers."""

    def __init__(self, routing: bool) -> None:
        self.model_s = 0.0
        self.routing: dict[int, torch.Tensor] | None = {} if routing else None

    def timed(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``, its wall time added to :attr:`model_s`."""
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.model_s += time.perf_counter() - t

    def record(self, out: ModelOutput, real_BT: torch.Tensor) -> None:
        """Add one forward's expert loads over the positions ``real_BT`` marks."""
        if self.routing is None:
            return
        for layer, r in out.routing.items():
            ids = r.expert_ids_NA[real_BT.reshape(-1).to(r.expert_ids_NA.device)].reshape(-1)
            counts = torch.bincount(ids, minlength=r.counts_E.numel()).cpu()
            self.routing[layer] = self.routing.get(layer, torch.zeros_like(counts)) + counts

    def answers(self, results: list, costs: list[Cost]) -> Answers:
        """The call's :class:`~evals.api.Answers`."""
        routing = {k: v.tolist() for k, v in (self.routing or {}).items()}
        return Answers(results, costs, model_s=self.model_s, routing=routing)


class Ernie5EvalModel:
    """One concrete sub-model of an ERNIE5 checkpoint, answering evaluation requests.

    Args:
        ckpt: the loaded checkpoint (its model is shared, never modified).
        subnet: the sub-model that answers (None = the full model).
        batch_size: requests per forward.
        routing: record expert loads in every answer.
        ckpt_hash: the checkpoint's hash, when the caller has it already (computed otherwise).
        share_context: score the choices that share a context after one forward of it, and encode
            a call's images and clips in batches (False: each request's whole document on its own
            and each item's media alone: the adapter before sharing, the baseline of ``ernie5 bench
            harness``).
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        subnet: Subnet | None = None,
        batch_size: int = 16,
        *,
        routing: bool = True,
        ckpt_hash: str | None = None,
        share_context: bool = True,
    ) -> None:
        if ckpt.tokenizer is None:
            raise EvalInputError(f"{ckpt.path}: the checkpoint has no tokenizer.json")
        self.ckpt = ckpt
        self.model = ckpt.model.eval()
        self.tokenizer = ckpt.tokenizer
        self.batch_size = batch_size
        self.max_len = ckpt.cfg.max_seq_len
        self.ckpt_hash = ckpt_hash or checkpoint_hash(ckpt.path)
        self.subnet = subnet or Subnet.full(ckpt.cfg)
        self.routing = routing
        self.share_context = share_context
        self.device = self.model.tok_emb.weight.device
        """Where the backbone runs (the sweep's ``device``): requests are built on the CPU, moved there
        for each forward, and the logits come back; the tokenizers and frozen media models stay on the
        CPU."""

    # ---------------------------------------------------------------- identity
    @property
    def fingerprint(self) -> str:
        """Checkpoint hash + the concrete sub-model + dtype + adapter version."""
        s = self.subnet
        dtype = self.model.tok_emb.weight.dtype
        ident = f"{self.ckpt_hash}|{s.layers}|{s.experts}|{s.top_k}|{dtype}|{ADAPTER_VERSION}"
        return f"{self.ckpt_hash}:{s.name}:{hashlib.sha256(ident.encode()).hexdigest()[:16]}"

    # ---------------------------------------------------------------- helpers
    def _text(self, context: Context) -> str:
        if isinstance(context, str):
            return context
        parts = []
        for p in context:
            if isinstance(p, MediaPart):
                raise EvalInputError(
                    f"this checkpoint has no {p.modality} tokenizer; "
                    f"{p.modality} inputs need a multimodal checkpoint"
                )
            parts.append(p)
        return "".join(parts)

    def _run(self, inputs: Inputs, real_BT: torch.Tensor, tally: _Tally, cache=None) -> ModelOutput:
        """One scoring forward of the sub-model (continuing ``cache`` when given), timed, with the
        expert loads of the positions ``real_BT`` marks recorded."""

        def forward() -> ModelOutput:
            if self.device.type == "cpu":
                return self.model(inputs, subnet=self.subnet, cache=cache)
            out = self.model(inputs.to(self.device), subnet=self.subnet, cache=cache)
            # The scoring reads the logits on the CPU, beside the requests' targets (the copy also
            # waits for the GPU, so the time is the forward's).
            return dataclasses.replace(out, logits_BTV=out.logits_BTV.cpu())

        with torch.inference_mode():
            out = tally.timed(forward)
        tally.record(out, real_BT)
        return out

    def _score(
        self, seqs: list[tuple[list[int], int]], tally: _Tally
    ) -> tuple[list[tuple[float, bool]], list[Cost]]:
        """Sum log P of the last ``n`` tokens of each sequence, whether they are all greedy, and
        each sequence's cost."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(seqs)
        costs: list[Cost] = [Cost()] * len(seqs)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            t0 = time.perf_counter()
            width = max(len(seqs[i][0]) for i in idx) - 1
            ids = torch.full((len(idx), width), PAD, dtype=torch.long)
            real = torch.zeros(len(idx), width, dtype=torch.bool)
            for row, i in enumerate(idx):
                toks = seqs[i][0]
                ids[row, : len(toks) - 1] = torch.tensor(toks[:-1])
                real[row, : len(toks) - 1] = True
            # Right padding: no real token attends to the padding after it (causal attention).
            logprobs = self._run(Inputs(ids), real, tally).logits_BTV.float().log_softmax(dim=-1)
            dt = (time.perf_counter() - t0) / len(idx)
            for row, i in enumerate(idx):
                toks, n = seqs[i]
                if n == 0:
                    results[i], costs[i] = (0.0, True), Cost(dt, len(toks), 0)
                    continue
                tgt = torch.tensor(toks[-n:])
                pos = torch.arange(len(toks) - 1 - n, len(toks) - 1)
                lp = logprobs[row, pos]
                results[i] = (float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all()))
                costs[i] = Cost(dt, len(toks) - n, n)
        return results, costs

    # ---------------------------------------------------------------- EvalModel
    def loglikelihood(self, requests: list[LoglikelihoodRequest]) -> Answers[LoglikelihoodResult]:
        """log P(continuation | context) per request (see module docstring for tokenisation); requests
        that share a context share its forward (:mod:`evals.shared_context`)."""
        tally = _Tally(self.routing)
        encoded = self._encode_media(requests)
        choices = [self._choice(i, r, encoded) for i, r in enumerate(requests)]

        def run(inputs: Inputs, real_BT: torch.Tensor, cache) -> ModelOutput:
            return self._run(inputs, real_BT, tally, cache)

        if self.share_context:
            scored = score_choices(choices, run, self.model.new_cache, self.batch_size)
        else:
            scored = score_each(choices, run, self.batch_size)
        results, costs = [], []
        for c in choices:
            got = scored[c.index]
            results.append(LoglikelihoodResult(got.logprob, got.greedy, len(c.cont)))
            costs.append(got.cost)
        return tally.answers(results, costs)

    def _choice(self, index: int, r: LoglikelihoodRequest, encoded: dict[int, list]) -> Choice:
        """One request as a continuation after a context document. Text: lm-eval's tokenisation, cut
        from the left to the window. Media: the parts before the last text part as segments (each
        image, clip or utterance encoded once per call however many choices share it), then that
        text part and the continuation."""
        if not _has_media(r.context):
            ctx_text = self._text(r.context)
            ctx, cont = self._split(ctx_text, r.continuation)
            toks = [BOS, *ctx, *cont][-(self.max_len + 1) :]
            n = min(len(cont), len(toks) - 1)
            prefix = toks[: len(toks) - n]
            return Choice(index, ("text", tuple(prefix)), [text_segment(prefix)], toks[len(toks) - n :])
        parts = list(r.context)
        last = parts.pop() if isinstance(parts[-1], str) else ""
        segs, key = [text_segment([BOS])], []
        for p in parts:
            if isinstance(p, MediaPart):
                segs += encoded[id(p.data)]
                key.append((p.modality, id(p.data)))
            else:
                segs.append(text_segment(self.tokenizer.encode(p)))
                key.append(p)
        ctx, cont = self._split(last, r.continuation)
        if ctx:
            segs.append(text_segment(ctx))
        length = sum(len(s) for s in segs) + len(cont)
        if length > self.max_len:
            raise EvalInputError(f"a media context of {length} positions exceeds max_seq_len={self.max_len}")
        return Choice(index, ("media", tuple(key), tuple(ctx)), segs, cont)

    def _encode_media(self, requests: list[LoglikelihoodRequest]) -> dict[int, list]:
        """``id(part.data)`` -> the segments of every media part of ``requests``, each encoded once
        however many choices share it; images and clips of one shape in batches (one at a time
        without ``share_context``)."""
        parts: dict[int, MediaPart] = {}
        for r in requests:
            if _has_media(r.context):
                parts.update((id(p.data), p) for p in r.context if isinstance(p, MediaPart))
        media = self._media_models()
        try:
            if self.share_context:
                segs = media_segments_many(list(parts.values()), **media)
            else:  # the adapter before sharing: one item at a time
                segs = [media_segments(p, **media) for p in parts.values()]
        except ContextError as e:
            raise EvalInputError(f"{self.ckpt.path}: {e}") from None
        return dict(zip(parts, segs, strict=True))

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens: the continuation is the token difference between
        ``encode(context + continuation)`` and ``encode(context)``, or encoded alone when BPE merges
        across the boundary."""
        ctx = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        return ctx, (whole[len(ctx) :] if whole[: len(ctx)] == ctx else self.tokenizer.encode(continuation))

    def loglikelihood_rolling(self, requests: list[RollingRequest]) -> Answers[RollingResult]:
        """log P(document), in half-overlapping windows of ``max_seq_len`` tokens."""
        tally = _Tally(self.routing)
        windows: list[tuple[list[int], int]] = []
        owner: list[int] = []
        n_tokens = []
        for i, r in enumerate(requests):
            toks = [BOS, *self.tokenizer.encode(r.text)]
            n_tokens.append(len(toks) - 1)
            mine = rolling_windows(toks, self.max_len)
            windows += mine
            owner += [i] * len(mine)
        scored, window_costs = self._score(windows, tally)
        totals = [0.0] * len(requests)
        spent = [(0.0, 0, 0)] * len(requests)
        for (lp, _), i, c in zip(scored, owner, window_costs, strict=True):
            totals[i] += lp
            s = spent[i]
            spent[i] = (s[0] + c.latency_s, s[1] + c.n_input_tokens, s[2] + c.n_output_tokens)
        results = [RollingResult(totals[i], n_tokens[i]) for i in range(len(requests))]
        return tally.answers(results, [Cost(*s) for s in spent])

    def generate(self, requests: list[GenerationRequest]) -> Answers[GenerationResult]:
        """Continuations cut at the first stop string; batched by generation settings and length."""
        tally = _Tally(self.routing)
        out: list[GenerationResult | None] = [None] * len(requests)
        costs: list[Cost] = [Cost()] * len(requests)
        prompts = []
        for r in requests:
            room = self.max_len - r.max_new_tokens
            if room < 1:
                raise EvalInputError(
                    f"max_new_tokens={r.max_new_tokens} leaves no room in max_seq_len={self.max_len}"
                )
            if _has_media(r.context):
                doc = self._context_segments(r.context)
                if sum(len(seg) for seg in doc) > room:
                    raise EvalInputError(
                        f"a media context of {sum(len(seg) for seg in doc)} positions leaves no room for "
                        f"{r.max_new_tokens} new tokens in max_seq_len={self.max_len}"
                    )
                prompts.append(doc)
            else:
                prompts.append([BOS, *self.tokenizer.encode(self._text(r.context))][-room:])
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_new_tokens, r.temperature, r.seed), []).append(i)
        for (max_new, temperature, seed), members in groups.items():
            members.sort(key=lambda i: -_prompt_len(prompts[i]))
            for start in range(0, len(members), self.batch_size):
                idx = members[start : start + self.batch_size]
                t0 = time.perf_counter()
                stops = [requests[i].stop for i in idx]
                batch = [prompts[i] for i in idx]
                new = self._generate_batch(batch, max_new, temperature, seed, stops, tally)
                dt = (time.perf_counter() - t0) / len(idx)
                for row, i in enumerate(idx):
                    text = cut_at_stop(self.tokenizer.decode(new[row]), requests[i].stop)
                    out[i] = GenerationResult(text, len(new[row]))
                    costs[i] = Cost(dt, _prompt_len(prompts[i]), len(new[row]))
        return tally.answers(out, costs)

    def _generate_batch(self, prompts, max_new, temperature, seed, stops, tally: _Tally) -> list[list[int]]:
        decode = self.tokenizer.decode

        def should_stop(row: int, toks: list[int]) -> bool:
            if not stops[row]:
                return False
            tail = decode(toks[-32:])
            return any(s in tail for s in stops[row])

        return tally.timed(
            generate,
            self.model,
            prompts,
            max_new,
            subnet=self.subnet,
            temperature=temperature,
            seed=seed,
            should_stop=should_stop,
            on_forward=tally.record if tally.routing is not None else None,
        )

    # ---------------------------------------------------------------- multimodal
    def _require_vision(self):
        if self.ckpt.vision_tokenizer is None or self.model.vision is None:
            raise EvalInputError(
                f"{self.ckpt.path}: not a vision checkpoint (no vision tokenizer or vision module)"
            )
        return self.ckpt.vision_tokenizer

    def _require_audio(self):
        if self.ckpt.audio_codec is None or self.model.audio is None:
            raise EvalInputError(
                f"{self.ckpt.path}: cannot read or write audio (no audio codec or audio module)"
            )
        return self.ckpt.audio_codec

    def _context_segments(self, context: Context) -> list:
        """BOS, then the context's text and media parts as segments of one document
        (:func:`ernie5.sequence.context.context_document`)."""
        try:
            return context_document(context, self.tokenizer, **self._media_models())
        except ContextError as e:
            raise EvalInputError(f"{self.ckpt.path}: {e}") from None

    def _media_models(self) -> dict:
        """The checkpoint's media readers (None where the model lacks the module: the context layout
        then names what is missing)."""
        vision = self.ckpt.vision_tokenizer is not None and self.model.vision is not None
        audio = self.ckpt.audio_codec is not None and self.model.audio is not None
        return {
            "vision_tokenizer": self.ckpt.vision_tokenizer if vision else None,
            "vision_cfg": self.ckpt.cfg.vision,
            "audio_codec": self.ckpt.audio_codec if audio else None,
        }

    def generate_media(self, requests: list[MediaGenerationRequest]) -> Answers[MediaResult]:
        """Images or clips for text prompts (NFSP with guidance), batched by settings."""
        vt = self._require_vision()
        tally = _Tally(self.routing)
        out: list[MediaResult | None] = [None] * len(requests)
        costs: list[Cost] = [Cost()] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.n_frames, r.cfg_scale, r.temperature, r.seed), []).append(i)
        per_frame = self.ckpt.cfg.vision.tokens_per_frame
        for (frames, cfg_scale, temperature, seed), idx in groups.items():
            for start in range(0, len(idx), self.batch_size):
                part = idx[start : start + self.batch_size]
                prompts = [[BOS, *prompt_ids(self.tokenizer, requests[i].prompt)] for i in part]
                t = time.perf_counter()
                media = tally.timed(
                    generate_media,
                    self.model,
                    vt,
                    prompts,
                    frames,
                    cfg_scale=cfg_scale,
                    temperature=temperature,
                    seed=seed,
                    subnet=self.subnet,
                )
                dt = (time.perf_counter() - t) / len(part)
                for row, i in enumerate(part):
                    out[i] = MediaResult(media[row], frames * per_frame)
                    costs[i] = Cost(dt, len(prompts[row]), frames * per_frame)
        return tally.answers(out, costs)

    def generate_speech(self, requests: list[SpeechGenerationRequest]) -> Answers[MediaResult]:
        """Waveforms for text prompts: Next-Codec Prediction, then the codec's decoder."""
        codec = self._require_audio()
        tally = _Tally(self.routing)
        out: list[MediaResult | None] = [None] * len(requests)
        costs: list[Cost] = [Cost()] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.max_frames, r.temperature, r.top_k, r.seed), []).append(i)
        q = self.ckpt.cfg.audio.n_levels
        n_spk = self.ckpt.cfg.audio.n_speakers
        for (max_frames, temperature, top_k, seed), idx in groups.items():
            sampling = AudioSampling(temperature=temperature, top_k=top_k, max_frames=max_frames, seed=seed)
            for start in range(0, len(idx), self.batch_size):
                part = idx[start : start + self.batch_size]
                prompts = []
                for i in part:
                    name = requests[i].speaker
                    spk = speaker_id(name) if name else -1
                    if name and not 0 <= spk < n_spk:
                        raise EvalInputError(
                            f"speaker {name!r} is not one this model knows (the FSDD speakers, "
                            f"{n_spk} embedding rows)"
                        )
                    ids = [BOS, *self.tokenizer.encode(requests[i].prompt)]
                    prompts.append(speech_prompt([text_segment(ids)], q, spk))
                t = time.perf_counter()
                codes = tally.timed(generate_audio, self.model, prompts, sampling, subnet=self.subnet)
                waves = tally.timed(audio_docs.decode_codes, codec, codes)
                dt = (time.perf_counter() - t) / len(part)
                for row, i in enumerate(part):
                    out[i] = MediaResult(waves[row], len(codes[row]))
                    costs[i] = Cost(dt, _prompt_len(prompts[row]), len(codes[row]))
        return tally.answers(out, costs)

    def reconstruct(self, requests: list[ReconstructionRequest]) -> Answers[MediaResult]:
        """Vision-tokenizer or audio-codec round trips (encode at full depth, decode)."""
        out = []
        for r in requests:
            if r.media.modality == "audio":
                codec = self._require_audio()
                codes = audio_docs.encode_waves(codec, [np.asarray(r.media.data, dtype=np.float32)])
                wave = audio_docs.decode_codes(codec, codes)[0][: len(r.media.data)]
                out.append(MediaResult(wave))
                continue
            vt = self._require_vision()
            clip = r.media.modality == "video"
            pixels = to_pixels(np.asarray(r.media.data), clip)
            with torch.inference_mode():
                rec = vt.decode(vt.encode(pixels).f_hat)
            out.append(MediaResult(to_uint8(rec)[0]))
        return Answers(out)

    def refine(self, requests: list[RefineRequest]) -> Answers[MediaResult]:
        """The cascaded refiner's 2x upsampling of images or clips (frame by frame)."""
        if self.ckpt.refiner is None:
            raise EvalInputError(f"{self.ckpt.path}: the checkpoint ships no cascaded refiner")
        tally = _Tally(False)
        out, costs = [], []
        for r in requests:
            t = time.perf_counter()
            data = np.asarray(r.media.data)
            frames = data[None] if r.media.modality == "image" else data
            hi = tally.timed(self.ckpt.refiner.refine, frames, steps=r.steps or None, seed=r.seed)
            out.append(MediaResult(hi))
            costs.append(Cost(time.perf_counter() - t, 0, 0))
        return tally.answers(out, costs)


def _prompt_len(prompt: list) -> int:
    """Positions of a prompt given as token ids or as a document of segments."""
    return sum(len(s) for s in prompt) if prompt and not isinstance(prompt[0], int) else len(prompt)


def _has_media(context: Context) -> bool:
    return not isinstance(context, str) and any(isinstance(p, MediaPart) for p in context)
