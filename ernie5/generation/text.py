"""Text generation with a KV cache: batched greedy/sampled decoding and MTP self-speculation.

Batched prompts of different lengths are left-padded; padding positions form their own document
(id -1), so no real token ever attends to them, and real positions start at 0 in every row.
Prompts given as documents of :class:`~ernie5.sequence.segments.Segment` (images, clips or audio next to
text) are packed one per row and right-padded instead; new tokens go after the longest prompt in
the cache and continue each row's own positions, which the document mask makes equivalent.

Self-speculative decoding (greedy, batch 1) uses the first MTP module as the drafter: after the
backbone picks token ``t_{n+1}`` at position ``n``, the MTP module drafts ``t_{n+2}`` from
``(h_n, t_{n+1})``. The next backbone forward runs on ``[t_{n+1}, draft]``; the draft is accepted
when it equals the backbone's own greedy choice, which then also yields the token after it. A
rejected draft is rolled back from the cache. Because every emitted token is the backbone's argmax
given the same prefix, the output equals plain greedy decoding.

References:
  * DeepSeek-V3 (arXiv 2412.19437) §2.2 and §5.4.3 (MTP for speculative decoding, 85-90 %
    acceptance of the second token); gpt-fast ``generate.py`` (prefill / decode_one structure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs
from ernie5.model.model import Ernie5Model, ModelOutput
from ernie5.model.rope import text_positions
from ernie5.sequence.segments import pack, text_segment
from ernie5.store.checkpoint import CheckpointError
from ernie5.subnets.spec import load_subnet
from ernie5.tokenizers.special import BOS, EOS, PAD


class GenerationError(ValueError):
    """Bad arguments to :func:`generate_text` (one-line message naming the value and what is expected)."""


@dataclass
class SpeculativeStats:
    """Counts of one speculative generation."""

    drafted: int = 0
    accepted: int = 0
    forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return self.accepted / self.drafted if self.drafted else 0.0


def sample_categorical(probs_BV: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """One index per row drawn from the (unnormalised, non-negative) ``probs_BV`` by inverting the
    CDF at one uniform draw per row: one cumulative sum and a binary search (``torch.multinomial``
    costs a sizeable share of a small model's decoding step on CPU). Index ``i`` is drawn for
    ``u * total`` in ``[cdf[i-1], cdf[i])``; a draw that
    rounds up to the total (about one in 2^24) lands on the last index."""
    cdf_BV = probs_BV.cumsum(dim=-1)
    # Drawn on the generator's device (``generate`` seeds a CPU one), then moved: the same draws,
    # and so the same tokens for a seed, wherever the model runs.
    gen_device = gen.device if gen is not None else probs_BV.device
    u_B1 = torch.rand(probs_BV.shape[0], 1, generator=gen, device=gen_device, dtype=cdf_BV.dtype)
    u_B1 = u_B1.to(probs_BV.device)
    idx_B1 = torch.searchsorted(cdf_BV, u_B1 * cdf_BV[:, -1:], right=True)
    return idx_B1.clamp_max_(probs_BV.shape[-1] - 1).squeeze(-1)


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first occurrence of any of ``stops`` (the evaluation harness and the RL
    rollouts cut generated answers the same way)."""
    cut = len(text)
    for s in stops:
        at = text.find(s)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


def _pick(logits_BV: torch.Tensor, temperature: float, gen: torch.Generator | None) -> torch.Tensor:
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    return sample_categorical(torch.softmax(logits_BV.float() / temperature, dim=-1), gen)


def _prefill_docs(model, docs: list, subnet, cache):
    """Pack multimodal prompt documents (one per row, right-padded) and run them through the cache."""
    lens = [sum(len(s) for s in d) for d in docs]
    t0 = max(lens)
    inputs = pack(docs, t0, n_rows=len(docs), one_per_row=True).inputs.to(model.tok_emb.weight.device)
    out = model(inputs, subnet=subnet, cache=cache)
    rows = torch.arange(len(docs))
    last = torch.tensor(lens) - 1
    next_pos = inputs.positions_3BT.amax(dim=0)[rows, last] + 1
    return out, inputs.doc_ids_BT >= 0, out.logits_BTV[rows, last], next_pos


@torch.inference_mode()
def generate(
    model: Ernie5Model,
    prompts: list[list[int]] | list[list],
    max_new_tokens: int,
    *,
    subnet: Subnet | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    eos_id: int | None = None,
    should_stop: Callable[[int, list[int]], bool] | None = None,
    on_forward: Callable[[ModelOutput, torch.Tensor], None] | None = None,
) -> list[list[int]]:
    """Continue each prompt; returns only the new tokens of each row.

    A prompt is token ids, or a document (a list of :class:`~ernie5.sequence.segments.Segment`) that may hold
    images, clips or audio.

    A row stops at ``eos_id`` (not returned), when ``should_stop(row, new_tokens)`` says so (e.g. a
    stop string appeared), or after ``max_new_tokens``. ``on_forward(output, real_BT)`` sees every
    forward's output with the mask of its non-padding positions (e.g. to count expert loads).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    device = model.tok_emb.weight.device
    b = len(prompts)
    is_doc = any(p and not isinstance(p[0], int) for p in prompts)
    if is_doc:
        prompts = [p if p and not isinstance(p[0], int) else [text_segment(p)] for p in prompts]
    lens = [sum(len(s) for s in p) if is_doc else len(p) for p in prompts]
    t0 = max(lens)
    total = t0 + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({t0}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={model.cfg.max_seq_len}"
        )
    cache = model.new_cache(b, total)
    gen = torch.Generator(device="cpu").manual_seed(seed) if temperature > 0 else None
    if is_doc:
        out, real, logits, next_pos = _prefill_docs(model, prompts, subnet, cache)
    else:
        ids = torch.full((b, t0), PAD, dtype=torch.long, device=device)
        doc = torch.full((b, t0), -1, dtype=torch.long, device=device)
        pos = torch.zeros(b, t0, dtype=torch.long, device=device)
        for r, p in enumerate(prompts):
            pad = t0 - len(p)
            ids[r, pad:] = torch.tensor(p, device=device)
            doc[r, pad:] = 0
            pos[r, pad:] = torch.arange(len(p), device=device)
        blk = torch.arange(t0, device=device).expand(b, t0)
        out = model(Inputs(ids, pos.expand(3, b, t0), doc, blk), subnet=subnet, cache=cache)
        real, logits = doc >= 0, out.logits_BTV[:, -1]
        next_pos = torch.tensor(lens, device=device)
    if on_forward is not None:
        on_forward(out, real)
    new: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    for step in range(max_new_tokens):
        tok = _pick(logits, temperature, gen)
        picked = tok.tolist()
        for r in range(b):
            if done[r]:
                continue
            t = picked[r]
            if eos_id is not None and t == eos_id:
                done[r] = True
                continue
            new[r].append(t)
            if should_stop is not None and should_stop(r, new[r]):
                done[r] = True
        if all(done) or step == max_new_tokens - 1:
            break
        step_inputs = Inputs(
            tok[:, None],
            positions_3BT=next_pos.view(1, b, 1).expand(3, b, 1),
            doc_ids_BT=torch.zeros(b, 1, dtype=torch.long, device=device),
            block_ids_BT=torch.full((b, 1), cache.length, device=device),
        )
        out = model(step_inputs, subnet=subnet, cache=cache)
        if on_forward is not None:
            on_forward(out, torch.tensor([[not d] for d in done], device=device))
        next_pos = next_pos + 1
        logits = out.logits_BTV[:, -1]
    return new


@torch.inference_mode()
def speculative_generate(
    model: Ernie5Model,
    prompt: list[int],
    max_new_tokens: int,
    *,
    subnet: Subnet | None = None,
    eos_id: int | None = None,
) -> tuple[list[int], SpeculativeStats]:
    """Greedy decoding of one prompt with MTP drafts; output equals :func:`generate` greedy."""
    if not model.mtp:
        raise ValueError("speculative decoding needs an MTP module (model.mtp.n_depth >= 1)")
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    device = model.tok_emb.weight.device
    n = len(prompt)
    total = n + max_new_tokens + 2
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({n}) + max_new_tokens ({max_new_tokens}) exceeds max_seq_len={model.cfg.max_seq_len}"
        )
    cache = model.new_cache(1, total)
    mtp_cache = model.new_cache(1, total, mtp=True)
    stats = SpeculativeStats()
    ids = torch.tensor([prompt], device=device)
    out = model(ids, subnet=subnet, cache=cache)
    stats.forwards += 1
    h = out.hidden_BTD  # hidden states of positions 0..n-1
    tok = int(out.logits_BTV[0, -1].argmax())
    new: list[int] = []
    # MTP entries exist for positions whose next token is known: 0..n-1 now.
    known_next = torch.tensor([prompt[1:] + [tok]], device=device)
    draft_logits = model.mtp_draft(h, known_next, mtp_cache, text_positions(1, n, 0, device))
    draft = int(draft_logits[0, -1].argmax())
    while len(new) < max_new_tokens:
        if eos_id is not None and tok == eos_id:
            break
        new.append(tok)
        if len(new) >= max_new_tokens:
            break
        base = cache.length
        pair = torch.tensor([[tok, draft]], device=device)
        out = model(pair, subnet=subnet, cache=cache)
        stats.forwards += 1
        stats.drafted += 1
        verify = out.logits_BTV[0].argmax(dim=-1).tolist()
        if verify[0] == draft:
            stats.accepted += 1
            if eos_id is not None and draft == eos_id:
                break
            new.append(draft)
            nxt = verify[1]
            h_new = out.hidden_BTD
            known = torch.tensor([[draft, nxt]], device=device)
            logits = model.mtp_draft(h_new, known, mtp_cache, text_positions(1, 2, base, device))
        else:
            cache.truncate(base + 1)  # drop the rejected draft's position
            nxt = verify[0]
            known = torch.tensor([[nxt]], device=device)
            logits = model.mtp_draft(
                out.hidden_BTD[:, :1], known, mtp_cache, text_positions(1, 1, base, device)
            )
        tok, draft = nxt, int(logits[0, -1].argmax())
    return new[:max_new_tokens], stats


def generate_text(
    checkpoint: str | Path,
    prompt: str,
    *,
    subnet: str | None = None,
    max_new_tokens: int = 64,
    speculative: bool = False,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[str, dict]:
    """Generate a continuation of ``prompt``; returns the text and decoding stats.

    Raises:
        GenerationError: ``max_new_tokens`` < 1, ``temperature`` negative or not a number, the prompt
            plus ``max_new_tokens`` longer than the model's context, or ``speculative`` on a model
            without MTP.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise GenerationError(f"max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    if not temperature >= 0:  # also NaN
        raise GenerationError(f"temperature={temperature!r}: expected a number >= 0 (0 = greedy)")
    ckpt, sub = load_subnet(checkpoint, subnet)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"{ckpt.path}: no tokenizer.json, cannot encode a text prompt")
    model = ckpt.model.eval()
    ids = [BOS, *ckpt.tokenizer.encode(prompt)]
    room = model.cfg.max_seq_len - len(ids) - (2 if speculative else 0)
    if max_new_tokens > room:
        raise GenerationError(
            f"max_new_tokens={max_new_tokens}: the prompt takes {len(ids)} of the model's "
            f"max_seq_len={model.cfg.max_seq_len} positions; expected at most {max(room, 0)}"
        )
    info: dict = {"subnet": sub.name}
    if speculative:
        if temperature > 0:
            raise CheckpointError("--speculative decodes greedily; drop --temperature")
        if not model.mtp:
            raise GenerationError("speculative decoding needs a model with an MTP module (mtp.n_depth >= 1)")
        new, stats = speculative_generate(model, ids, max_new_tokens, subnet=sub, eos_id=EOS)
        info.update(
            acceptance_rate=round(stats.acceptance_rate, 4), drafted=stats.drafted, forwards=stats.forwards
        )
    else:
        new = generate(
            model, [ids], max_new_tokens, subnet=sub, temperature=temperature, seed=seed, eos_id=EOS
        )[0]
    info["new_tokens"] = len(new)
    return ckpt.tokenizer.decode(new), info
