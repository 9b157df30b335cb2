"""Next-Frame-and-Scale Prediction sampling: text prompt -> image or clip, with classifier-free guidance.

For every frame (oldest first) and every scale (coarsest first) one backbone forward runs the
scale's block with the KV cache: its inputs are the VAR inputs of that scale (the downsampled sum of
the coarser scales of this frame; the learned start embedding for the first scale of the first frame;
the previous frame's accumulated map for the first scale of a later frame), and the bitwise head
gives one logit per bit of every token of the scale. With guidance, an unconditional row (the prompt
replaced by ``BOS BOI``) runs beside every conditional row and the logits are mixed
``l = l_u + s (l_c - l_u)``; both rows then continue from the same sampled bits. Bits are sampled
from ``sigmoid(l / temperature)`` (``temperature = 0``: the sign of ``l``). The frozen tokenizer
turns the bits into the accumulated latent and decodes the pixels.

References:
  * VAR (arXiv 2404.02905) sampling with a KV cache and CFG; Infinity (arXiv 2412.04431) bitwise
    sampling; ERNIE 5.0 Technical Report §2.2.3 (NFSP).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ernie5.model.elastic import Subnet
from ernie5.model.inputs import Inputs, VisionGen, VisionInputs
from ernie5.model.model import Ernie5Model
from ernie5.model.vision import nfsp_layout
from ernie5.sequence.vision import to_uint8
from ernie5.tokenizers.special import BOI, BOS, BOV, PAD


@torch.inference_mode()
def generate_media(
    model: Ernie5Model,
    tokenizer,
    prompts: list[list[int]],
    n_frames: int = 1,
    *,
    cfg_scale: float = 3.0,
    temperature: float = 1.0,
    seed: int = 0,
    subnet: Subnet | None = None,
) -> np.ndarray:
    """Generate one image (``n_frames = 1``) or clip per prompt; returns uint8 ``(N, T, H, W, 3)``.

    Each prompt is token ids that should end with BOI (images) or BOV (clips); they are appended
    when missing.
    """
    cfg = model.cfg.vision
    if model.vision is None:
        raise ValueError("this model has no vision module (model.vision.enabled is false)")
    if not 1 <= n_frames <= cfg.max_frames:
        raise ValueError(f"n_frames={n_frames} must be in [1, {cfg.max_frames}]")
    begin = BOV if n_frames > 1 else BOI
    prompts = [p if p and p[-1] == begin else [*p, begin] for p in prompts]
    guided = cfg_scale != 1.0
    rows_prompts = prompts + ([[BOS, begin]] * len(prompts) if guided else [])
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        if temperature <= 0:
            return torch.where(logits >= 0, 1.0, -1.0)
        p = torch.sigmoid(logits / temperature)
        return torch.where(torch.rand(p.shape, generator=gen) < p, 1.0, -1.0)

    frames_bits = sample_scales(
        model, tokenizer, rows_prompts, len(prompts), n_frames, cfg_scale=cfg_scale, subnet=subnet, pick=pick
    )
    clip_bits = [torch.cat([fb[k] for fb in frames_bits], dim=1) for k in range(len(cfg.scales))]
    pixels = tokenizer.decode(tokenizer.codes_to_fhat(clip_bits))
    return to_uint8(pixels)


def sample_scales(
    model: Ernie5Model,
    tokenizer,
    rows_prompts: list[list[int]],
    n: int,
    n_frames: int,
    *,
    cfg_scale: float,
    subnet: Subnet | None,
    pick: Callable[[torch.Tensor], torch.Tensor],
) -> list[list[torch.Tensor]]:
    """The NFSP sampling loop: prefill ``rows_prompts`` (``n`` conditional prompts ending with BOI or
    BOV, then, when ``cfg_scale != 1``, ``n`` unconditional ones), then predict every scale of every
    frame from the bits sampled so far. ``pick`` turns a scale's guided bit logits ``(n, s*s, D)``
    into bits in {-1, +1} (and may record what it drew: the RL rollouts keep the log-probs).

    Returns the bits per frame, per scale, ``(n, 1, s, s, D)``.
    """
    cfg = model.cfg.vision
    guided = cfg_scale != 1.0
    rows = len(rows_prompts)
    device = model.tok_emb.weight.device
    t0 = max(len(p) for p in rows_prompts)
    total = t0 + n_frames * cfg.tokens_per_frame
    if total > model.cfg.max_seq_len:
        raise ValueError(f"prompt ({t0}) + {n_frames} frame(s) exceed max_seq_len={model.cfg.max_seq_len}")
    ids = torch.full((rows, t0), PAD, dtype=torch.long, device=device)
    doc = torch.full((rows, t0), -1, dtype=torch.long, device=device)
    pos = torch.zeros(rows, t0, dtype=torch.long, device=device)
    for r, p in enumerate(rows_prompts):
        ids[r, t0 - len(p) :] = torch.tensor(p, device=device)
        doc[r, t0 - len(p) :] = 0
        pos[r, t0 - len(p) :] = torch.arange(len(p), device=device)
    cache = model.new_cache(rows, total)
    blk = torch.arange(t0, device=device).expand(rows, t0)
    prompt_inputs = Inputs(ids, pos.expand(3, rows, t0), doc, blk)
    model(prompt_inputs, subnet=subnet, cache=cache, return_logits=False)
    base = torch.tensor([len(p) for p in rows_prompts], device=device)  # first position after the prompt
    lay = nfsp_layout(cfg, n_frames)
    d = cfg.latent_bits
    frames_bits: list[list[torch.Tensor]] = []  # per frame, per scale: (n, 1, s, s, D)
    offset = 0
    for f in range(n_frames):
        bits_f: list[torch.Tensor] = []
        for k, s in enumerate(cfg.scales):
            m = s * s
            sl = slice(offset, offset + m)
            offset += m
            start = torch.zeros(m, dtype=torch.bool)
            if k == 0 and f == 0:
                inputs = torch.zeros(n, m, d)
                start[:] = True
            elif k == 0:
                inputs = _prev_frame_input(tokenizer, cfg, frames_bits[-1])
            else:
                padded = bits_f + [torch.zeros(n, 1, q, q, d) for q in cfg.scales[k:]]
                inputs = tokenizer.scale_inputs(padded)[k].reshape(n, m, d)
            inputs = torch.cat([inputs, inputs]) if guided else inputs
            positions = lay["positions"][:, sl].to(device)[:, None, :] + base[None, :, None]  # (3, rows, m)
            scale_inputs = Inputs(
                torch.full((rows, m), PAD, dtype=torch.long, device=device),
                positions_3BT=positions,
                doc_ids_BT=torch.zeros(rows, m, dtype=torch.long, device=device),
                block_ids_BT=torch.full((rows, m), cache.length, device=device),
                vision=VisionInputs(
                    [],
                    None,
                    VisionGen(
                        inputs.reshape(rows * m, d).to(device),
                        torch.full((rows * m,), k, device=device),
                        start.repeat(rows).to(device),
                        cell_P=lay["cell"][sl].repeat(rows).to(device),
                    ),
                    torch.ones(rows, m, dtype=torch.bool, device=device),
                ),
            )
            out = model(scale_inputs, subnet=subnet, cache=cache, return_logits=False)
            logits = out.bit_logits_PD.view(rows, m, d).cpu()
            if guided:
                logits = logits[n:] + cfg_scale * (logits[:n] - logits[n:])
            bits_f.append(pick(logits).view(n, 1, s, s, d))
        frames_bits.append(bits_f)
    return frames_bits


def _prev_frame_input(tokenizer, cfg, bits_prev: list[torch.Tensor]) -> torch.Tensor:
    """(n, n0*n0, D): the previous frame's accumulated latent at the first scale."""
    from ernie5.tokenizers.vision_quant import area_downsample

    f_hat = tokenizer.codes_to_fhat(bits_prev)[:, :, 0]  # (n, D, h, w)
    n0 = cfg.scales[0]
    down = area_downsample(f_hat, n0)  # (n, D, n0, n0)
    return down.permute(0, 2, 3, 1).reshape(f_hat.shape[0], n0 * n0, -1)
