"""Next-Codec Prediction sampling: a prompt document -> codec frames, every level of a frame per forward.

The prompt (text, and optionally images or audio) is packed one document per row and ends with
``BOA`` and an audio start position (a speaker embedding for TTS, or the generic start). Each
backbone forward then runs one position per row with the KV cache: the start position, later the
summed embedding of the frame just sampled. At the top ``Q`` kept layers the NCP heads pick the
levels of the next frame one after another, each code's embedding added to the hidden state before
the next layer (:mod:`ernie5.model.audio`), so all ``Q`` codes of a frame come out of one forward.
A row stops when level 1 picks END (or after ``max_frames``).

The loop (:func:`sample_frames`) takes the draw as a callback: the harness's :func:`generate_audio`
draws with :func:`ncp_logits` and :func:`draw_codes`; the RL rollouts (``train.rl.rollout_audio``) make the
same draws and keep each code's log-prob.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §2.3.2 (NCP, audio heads in the top layers);
    DnD-Transformer (arXiv 2410.01912).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ernie5.model.elastic import Subnet
from ernie5.model.inputs import AudioInputs, Inputs
from ernie5.model.model import Ernie5Model
from ernie5.sequence.segments import AudioSeg, Segment, pack, text_segment
from ernie5.tokenizers.special import BOA, PAD


@dataclass(frozen=True)
class AudioSampling:
    """How codes are picked from the NCP logits."""

    temperature: float = 0.0
    """0 = argmax; otherwise softmax sampling at this temperature."""
    top_k: int = 0
    """Sample among the ``top_k`` most likely codes (0 = all)."""
    min_frames: int = 1
    """END is not allowed before this many frames."""
    max_frames: int = 64
    """A row stops after this many frames even without END."""
    seed: int = 0


def speech_prompt(prefix: list[Segment], n_levels: int, speaker: int = -1) -> list[Segment]:
    """``prefix`` + BOA + an audio start position (the document a TTS/audio continuation starts from)."""
    start = AudioSeg(torch.zeros(0, n_levels, dtype=torch.long), start=True, speaker=speaker)
    return [*prefix, text_segment([BOA], loss=False), Segment("audio", audio=start)]


def ncp_logits(
    level: int, logits_PK: torch.Tensor, n_done_P: torch.Tensor, sampling: AudioSampling, end_code: int
) -> torch.Tensor:
    """The logits a level's code is drawn from: float, END (level 1 only) at ``-inf`` for rows with fewer
    than ``min_frames`` frames so far, and, with ``top_k``, every code below the ``top_k``-th at ``-inf``.
    Sampling is ``softmax(ncp_logits / temperature)``; the RL rollouts take their log-probs from it."""
    logits = logits_PK.float().clone()
    if level == 0:
        logits[n_done_P.to(logits.device) < sampling.min_frames, end_code] = float("-inf")
    if sampling.temperature > 0 and 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def draw_codes(logits_PK: torch.Tensor, sampling: AudioSampling, gen: torch.Generator) -> torch.Tensor:
    """One code per row from :func:`ncp_logits`' output: the argmax at temperature 0, else a draw from
    ``softmax(logits / temperature)`` with ``gen`` (on the CPU, one multinomial call per level)."""
    if sampling.temperature <= 0:
        return logits_PK.argmax(dim=-1)
    probs = torch.softmax(logits_PK / sampling.temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits_PK.device)


Pick = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(level, logits_PK, n_done_P) -> codes_P``: how a level's codes are chosen from the head's logits
(``n_done_P``: each row's frames so far, on the CPU)."""


@torch.inference_mode()
def generate_audio(
    model: Ernie5Model,
    prompts: list[list[Segment]],
    sampling: AudioSampling = AudioSampling(),
    *,
    subnet: Subnet | None = None,
) -> list[torch.Tensor]:
    """Sample codec frames after each prompt document (see :func:`speech_prompt`).

    Returns one ``(n_frames, Q)`` int64 tensor of codes per prompt (END not included).
    """
    if model.audio is None:
        raise ValueError("this model has no audio module (model.audio.enabled is false)")
    end_code = model.cfg.audio.end_code
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed)

    def pick(level: int, logits_PK: torch.Tensor, n_done_P: torch.Tensor) -> torch.Tensor:
        return draw_codes(ncp_logits(level, logits_PK, n_done_P, sampling, end_code), sampling, gen)

    codes, _ = sample_frames(model, prompts, sampling.max_frames, pick, subnet=subnet)
    return codes


def sample_frames(
    model: Ernie5Model,
    prompts: list[list[Segment]],
    max_frames: int,
    pick: Pick,
    *,
    subnet: Subnet | None = None,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The NCP sampling loop: prefill the prompt documents (one per row, each ending with an audio start
    position), then one KV-cache forward per frame, ``pick`` choosing every level of the frame in turn
    (level 1 first; END there ends the row). Every row is fed until all rows ended or ``max_frames``
    frames were sampled; ``pick`` may record what it drew (the RL rollouts keep the log-probs): its
    ``j``-th call for a level is the forward that predicts frame ``j + 1`` (or END).

    Returns each row's ``(n_frames, Q)`` codes (END not included) and whether it ended with END ``(N,)``.
    """
    if model.audio is None:
        raise ValueError("this model has no audio module (model.audio.enabled is false)")
    ac = model.cfg.audio
    for p in prompts:
        last = p[-1] if p else None
        if last is None or last.audio is None or not last.audio.start or len(last.audio.codes_NQ):
            raise ValueError("an audio prompt must end with an audio start position (use speech_prompt)")
    device = model.tok_emb.weight.device
    b = len(prompts)
    lens = [sum(len(s) for s in p) for p in prompts]
    t0 = max(lens)
    total = t0 + max_frames
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({t0}) + max_frames ({max_frames}) exceeds max_seq_len={model.cfg.max_seq_len}"
        )
    inputs = pack(prompts, t0, n_rows=b, one_per_row=True).inputs.to(device)
    rows, last = torch.arange(b), torch.tensor(lens) - 1
    pred = torch.zeros(b, t0, dtype=torch.bool, device=device)
    pred[rows, last] = True
    inputs.audio = replace(inputs.audio, targets_PQ=None, pred_mask_BT=pred)
    n_done = torch.zeros(b, dtype=torch.long)

    def sampler(level: int, logits_PK: torch.Tensor) -> torch.Tensor:
        return pick(level, logits_PK, n_done)

    cache = model.new_cache(b, total)
    out = model(inputs, audio_sampler=sampler, subnet=subnet, cache=cache, return_logits=False)
    next_pos = inputs.positions_3BT.amax(dim=0)[rows, last] + 1
    frames: list[list[torch.Tensor]] = [[] for _ in range(b)]
    done = torch.zeros(b, dtype=torch.bool)
    ended_any = torch.zeros(b, dtype=torch.bool)
    codes = out.audio_codes_PQ.cpu()
    for step in range(max_frames):
        ended = codes[:, 0] == ac.end_code
        for r in range(b):
            if not done[r] and not ended[r]:
                frames[r].append(codes[r])
        ended_any |= ended & ~done
        done |= ended
        n_done += (~done).long()
        if bool(done.all()) or step == max_frames - 1:
            break
        inp = torch.where(ended[:, None], torch.zeros_like(codes), codes).to(device)
        ones = torch.ones(b, 1, dtype=torch.bool, device=device)
        step_inputs = Inputs(
            torch.full((b, 1), PAD, dtype=torch.long, device=device),
            positions_3BT=next_pos.view(1, b, 1).expand(3, b, 1),
            doc_ids_BT=torch.zeros(b, 1, dtype=torch.long, device=device),
            block_ids_BT=torch.full((b, 1), cache.length, device=device),
            audio=AudioInputs(inp, ones, None, None, None, ones),
        )
        out = model(step_inputs, audio_sampler=sampler, subnet=subnet, cache=cache, return_logits=False)
        next_pos = next_pos + 1
        codes = out.audio_codes_PQ.cpu()
    q = ac.n_levels
    codes_out = [torch.stack(f) if f else torch.zeros(0, q, dtype=torch.long) for f in frames]
    return codes_out, ended_any
