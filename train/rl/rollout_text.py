"""The RL rollout engine: batched KV-cache sampling that records behaviour log-probs and expert routing.

:meth:`RolloutEngine.advance` extends a list of :class:`~train.rl.buffer.Rollout` s by at most ``budget``
tokens each: their prompts (any modality the context holds: text, images, clips, audio, through
:func:`ernie5.sequence.context.context_document`) plus the tokens sampled so far are packed one per row
and prefilled into a fresh KV cache with the current weights, then decoded step by step. For every sampled
token the engine stores its log-prob under the sampling distribution (``softmax(logits / temperature)``:
the behaviour policy ``pi_infer``), the policy version, and, for every position it feeds, the expert ids
each MoE layer chose, so that the learner can recompute log-probs with the rollout's routing replayed.

A response ends at EOS (kept as its last token: the policy is trained to stop), when its decoded tail
contains one of the query's stop strings (the harness cuts its answers at the same strings), or at its
token budget (``truncated``).

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §4 (unified multimodal RL; rollouts are > 90 % of RL
    time) and §5.4 (Rollout Router Replay); Ma et al. 2025 (arXiv 2510.11370), R3.

Deviations:
  1. Text responses only here: image answers (NFSP, ``t2i_shapes``) are rolled out by
     :mod:`train.rl.rollout_image` and speech answers (NCP, ``tts_dtmf``, ``tts_digits``) by
     :mod:`train.rl.rollout_audio`, both rewarded by the task's judge.
  2. Each round re-prefills the rollouts it continues (no cache kept across rounds), and a rollout's
     routing of an earlier position is the one of the latest forward over it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ernie5.generation.text import cut_at_stop, sample_categorical
from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.sequence.context import context_document
from ernie5.sequence.segments import Segment, pack, text_segment
from ernie5.tokenizers.special import EOS
from train.rl.buffer import OutputRollouts, Rollout


@dataclass
class Prompt:
    """What the engine needs of a rollout's query."""

    doc: list[Segment]
    """The context as one document (BOS first), without the hint."""
    max_new_tokens: int
    stop: tuple[str, ...]


def rollout_document(prompt: Prompt, r: Rollout, with_tokens: bool = True) -> list[Segment]:
    """Prompt, hint and (``with_tokens``) the response so far, as one document."""
    doc = list(prompt.doc)
    if r.hint:
        doc.append(text_segment(r.hint, loss=False))
    if with_tokens and r.tokens:
        doc.append(text_segment(r.tokens))
    return doc


class RolloutEngine:
    """Samples from ``model`` (the policy's compute copy) for the rollouts handed to :meth:`advance`."""

    def __init__(
        self,
        model,
        tokenizer,
        prompt_of: Callable[[Rollout], Prompt],
        *,
        temperature: float = 1.0,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_of = prompt_of
        self.temperature = temperature
        self.seed = seed

    def _stopped(self, tokens: list[int], stops: tuple[str, ...]) -> bool:
        return bool(stops) and any(s in self.tokenizer.decode(tokens[-32:]) for s in stops)

    @torch.inference_mode()
    def advance(
        self, rollouts: list[Rollout], budget: int, round_: int, subnet: Subnet, version: int
    ) -> tuple[int, int]:
        """Extend every unfinished rollout by at most ``budget`` tokens under ``subnet``.

        Returns ``(decode_steps, tokens_sampled)``. Sampling draws come from a generator seeded by
        ``(seed, round_)``, so a round is reproducible from the rollouts it is given.
        """
        rows = [r for r in rollouts if not r.done]
        if not rows:
            return 0, 0
        model = self.model
        device = model.tok_emb.weight.device
        prompts = [self.prompt_of(r) for r in rows]
        docs = [rollout_document(p, r) for p, r in zip(prompts, rows, strict=True)]
        lens = [sum(len(s) for s in d) for d in docs]
        left = [p.max_new_tokens - len(r.tokens) for p, r in zip(prompts, rows, strict=True)]
        steps = min(budget, max(left))
        b, t0 = len(rows), max(lens)
        if t0 + steps > model.cfg.max_seq_len:
            raise ValueError(
                f"a rollout needs {t0 + steps} positions > max_seq_len={model.cfg.max_seq_len}; "
                "lower rollout.max_new_tokens"
            )
        cache = model.new_cache(b, t0 + steps)
        inputs = pack(docs, t0, n_rows=b, one_per_row=True).inputs.to(device)
        out = model(inputs, subnet=subnet, cache=cache)
        prefill_ids = {
            i: ro.expert_ids_NA.view(b, t0, -1).to(torch.int16).cpu() for i, ro in out.routing.items()
        }
        step_ids: dict[int, list[torch.Tensor]] = {i: [] for i in prefill_ids}  # per fed step, (B, A)
        fed: list[list[bool]] = []  # per fed step, which rows fed a token of their own
        idx = torch.arange(b, device=device)
        last = torch.tensor(lens, device=device) - 1
        logits_BV = out.logits_BTV[idx, last]
        next_pos = inputs.positions_3BT.amax(dim=0)[idx, last] + 1
        gen = torch.Generator().manual_seed(hash((self.seed, round_)) % (1 << 62))
        active = [True] * b
        sampled = 0
        done_steps = 0
        for step in range(steps):
            logp_BV = torch.log_softmax(logits_BV.float() / self.temperature, dim=-1)
            tok_B = sample_categorical(logp_BV.exp(), gen)
            tok_logp = logp_BV.gather(-1, tok_B[:, None]).squeeze(-1).tolist()
            picked = tok_B.tolist()
            done_steps = step + 1
            for k, r in enumerate(rows):
                if not active[k]:
                    continue
                r.tokens.append(picked[k])
                r.logp.append(tok_logp[k])
                r.versions.append(version)
                sampled += 1
                if picked[k] == EOS or self._stopped(r.tokens, prompts[k].stop):
                    r.done, active[k] = True, False
                elif len(r.tokens) >= prompts[k].max_new_tokens:
                    r.done, r.truncated, active[k] = True, True, False
            if not any(active) or step == steps - 1:
                break
            step_inputs = Inputs(
                tok_B[:, None].to(device),
                positions_3BT=next_pos.view(1, b, 1).expand(3, b, 1),
                doc_ids_BT=torch.zeros(b, 1, dtype=torch.long, device=device),
                block_ids_BT=torch.full((b, 1), cache.length, device=device),
            )
            out = model(step_inputs, subnet=subnet, cache=cache)
            for i, ro in out.routing.items():
                step_ids[i].append(ro.expert_ids_NA.view(b, -1).to(torch.int16).cpu())
            fed.append(list(active))
            next_pos = next_pos + 1
            logits_BV = out.logits_BTV[:, -1]
        fed_SB = torch.tensor(fed, dtype=torch.bool).view(len(fed), b)
        for i, prefill_BTA in prefill_ids.items():
            steps_SBA = (
                torch.stack(step_ids[i])
                if step_ids[i]
                else prefill_BTA.new_zeros(0, b, prefill_BTA.shape[-1])
            )
            for k, r in enumerate(rows):
                r.routing[i] = torch.cat([prefill_BTA[k, : lens[k]], steps_SBA[fed_SB[:, k], k]])
        return done_steps, sampled

    def response_text(self, r: Rollout, stops: tuple[str, ...]) -> str:
        """The response as the harness would read it: the sampled tokens (EOS dropped; an AHRL hint is
        prompt, not response), cut at the stops."""
        toks = [t for t in r.tokens if t != EOS]
        return cut_at_stop(self.tokenizer.decode(toks), stops)


@dataclass
class LearnerBatch:
    """What the learner's forward over a set of text rollouts needs."""

    inputs: Inputs
    pos_BT: torch.Tensor
    """Position whose logits predict each response token (0 past a row's response)."""
    tok_BT: torch.Tensor
    """The response tokens (0 past a row's response)."""
    routing: dict[int, torch.Tensor] | None
    """MoE layer -> ``(B, T, A)`` replayed expert ids, or None (route afresh)."""


class TextRollouts(OutputRollouts):
    """Text answers of the RL loop: each query's prompt (its context as one document, any modality),
    the engine that samples them, their answers as the harness reads them, and the learner's batches
    and log-probs."""

    def __init__(
        self,
        model,
        tokenizer,
        query_of: Callable[[int], Any],
        *,
        vision_tokenizer,
        vision_cfg,
        audio_codec,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        super().__init__(query_of)
        self.media = {
            "vision_tokenizer": vision_tokenizer,
            "vision_cfg": vision_cfg,
            "audio_codec": audio_codec,
        }
        self.max_new_tokens = max_new_tokens
        """Cap on a response's tokens (0 = each query's own budget)."""
        self.temperature = temperature
        self.engine = RolloutEngine(model, tokenizer, self.prompt, temperature=temperature, seed=seed)

    def make_prompt(self, query: Any) -> Prompt:
        """The query's context as one document (any modality), its budget (capped by
        ``max_new_tokens``) and its stop strings."""
        doc = context_document(query.context, self.tokenizer, **self.media)
        cap = self.max_new_tokens
        budget = min(query.max_new_tokens, cap) if cap else query.max_new_tokens
        return Prompt(doc, budget, tuple(query.stop))

    def answers(self, rows: list[Rollout]) -> list[str]:
        """Each finished rollout's response text, cut at its query's stop strings."""
        return [self.engine.response_text(r, tuple(self.query_of(r.query).stop)) for r in rows]

    def learner_batch(self, rows: list[Rollout], replay: bool) -> LearnerBatch:
        """Prompt + response of each row packed one per row, the response tokens' positions, and the
        rollouts' expert ids (``replay``; -1 where a position was never fed)."""
        docs = [rollout_document(self.prompt(r), r) for r in rows]
        lens = [sum(len(s) for s in d) for d in docs]
        width = max(lens)
        n_max = max(len(r.tokens) for r in rows)
        pos_BT = torch.zeros(len(rows), n_max, dtype=torch.long)
        tok_BT = torch.zeros(len(rows), n_max, dtype=torch.long)
        for k, (r, n) in enumerate(zip(rows, lens, strict=True)):
            m = len(r.tokens)
            pos_BT[k, :m] = torch.arange(n - m - 1, n - 1)  # response token j is predicted at n - m - 1 + j
            tok_BT[k, :m] = torch.tensor(r.tokens)
        routing = None
        if replay:
            routing = {}
            for layer, first in rows[0].routing.items():
                ids = torch.full((len(rows), width, first.shape[1]), -1, dtype=torch.long)
                for k, r in enumerate(rows):
                    ids[k, : len(r.routing[layer])] = r.routing[layer].long()
                routing[layer] = ids
        inputs = pack(docs, width, n_rows=len(rows), one_per_row=True).inputs
        return LearnerBatch(inputs, pos_BT, tok_BT, routing)

    @torch.no_grad()
    def routing_disagreement(self, rows: list[Rollout], subnet: Subnet, device) -> tuple[int, int]:
        """How many of the rollouts' routing decisions (MoE layer x fed position) the learner, routing
        afresh at the same weights, makes differently (another top-k set), and how many there are."""
        batch = self.learner_batch(rows, replay=False)
        inputs = batch.inputs.to(device)
        out = self.model(inputs, subnet=subnet)
        width = inputs.ids_BT.shape[1]
        n_diff = n_all = 0
        for layer, ro in out.routing.items():
            ids_BTA = ro.expert_ids_NA.view(len(rows), width, -1).sort(-1).values.cpu()
            for k, r in enumerate(rows):
                fed = r.routing.get(layer)
                if fed is None or not len(fed):
                    continue
                n = len(fed)
                same = (ids_BTA[k, :n] == fed.long().sort(-1).values).all(-1)
                n_diff += int((~same).sum())
                n_all += n
        return n_diff, n_all

    def logprobs(
        self, batch: LearnerBatch, subnet: Subnet, model: torch.nn.Module | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs (with grad when enabled) and entropies of the response tokens, at the
        sampling temperature, with the rollout's routing replayed when the batch has it; under
        ``model`` (the KL's reference policy) instead of the policy when given."""
        kwargs = {"routing_replay": batch.routing} if batch.routing is not None else {}
        out = (model or self.model)(batch.inputs, subnet=subnet, **kwargs)
        rows = torch.arange(batch.pos_BT.shape[0], device=batch.pos_BT.device)[:, None]
        logits_BTV = out.logits_BTV[rows, batch.pos_BT].float() / self.temperature
        logp_BTV = torch.log_softmax(logits_BTV, dim=-1)
        logp_BT = logp_BTV.gather(-1, batch.tok_BT[..., None]).squeeze(-1)
        ent_BT = -(logp_BTV.exp() * logp_BTV).sum(-1)
        return logp_BT, ent_BT.detach()
