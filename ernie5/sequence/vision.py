"""Images and clips as segments of the unified sequence (understanding and NFSP generation).

Document shapes (report Fig. 2):
  * understanding: ``... BOI <merged embeddings> EOI <text>`` (BOV/EOV for clips); the merged
    positions form one attention block and carry no loss;
  * generation: ``<text prompt> BOI F1S1 F1S2 ... F1SK F2S1 ... EOI`` (BOV/EOV for clips), every
    (frame, scale) one block, bit targets on every generation position.

The frozen vision tokenizer runs outside the backbone (report §5.2, tokenizer-backbone
disaggregation): :func:`encode_media` turns uint8 pixels into the understanding inputs (pixels and
pre-quantisation CNN features) and the generation codes, and the builders below lay them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ernie5.model.config import VisionConfig
from ernie5.model.inputs import VisionGen, VisionUnd
from ernie5.model.vision import nfsp_layout, scale_loss_weights, und_layout
from ernie5.sequence.chat import context_segment
from ernie5.sequence.segments import Segment, text_segment
from ernie5.tokenizers.special import BOI, BOS, BOV, EOI, EOS, EOV


def to_pixels(media: np.ndarray, clip: bool) -> torch.Tensor:
    """uint8 media -> float in [-1, 1] shaped ``(N, 3, T, H, W)``.

    ``clip=False``: one image ``(H, W, 3)`` or a batch ``(N, H, W, 3)``; ``clip=True``: one clip
    ``(T, H, W, 3)`` or a batch ``(N, T, H, W, 3)``.
    """
    x = torch.as_tensor(np.array(media, copy=True))
    if clip:
        x = x[None] if x.dim() == 4 else x
    else:
        x = (x[None] if x.dim() == 3 else x)[:, None]
    if x.dim() != 5 or x.shape[-1] != 3:
        raise ValueError(
            f"expected uint8 {'clips' if clip else 'images'} with 3 channels, got shape {tuple(media.shape)}"
        )
    return x.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def to_uint8(pixels_NCTHW: torch.Tensor) -> np.ndarray:
    """float in [-1, 1] ``(N, 3, T, H, W)`` -> uint8 ``(N, T, H, W, 3)``."""
    x = ((pixels_NCTHW.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1).cpu().numpy()


@dataclass
class EncodedMedia:
    """Tokenizer outputs of ``N`` items with the same frame count."""

    pixels: torch.Tensor
    """(N, 3, T, H, W) in [-1, 1]."""
    cnn: torch.Tensor
    """(N, C, T, h, w) pre-quantisation features."""
    bits: list[torch.Tensor] | None = None
    """Per scale (N, T, n, n, D) in {-1, +1}: generation targets."""
    input_bits: list[torch.Tensor] | None = None
    """Per scale: the bits accumulated into the inputs (targets after self-correction flips)."""


@torch.no_grad()
def encode_media(
    tokenizer,
    pixels_NCTHW: torch.Tensor,
    codes: bool,
    flip_prob: float = 0.0,
    generator: torch.Generator | None = None,
) -> EncodedMedia:
    """Run the frozen vision tokenizer once over a batch of same-length items."""
    cnn, z = tokenizer.encode_features(pixels_NCTHW)
    out = EncodedMedia(pixels_NCTHW, cnn)
    if codes:
        q = tokenizer.quantize(z, flip_prob=flip_prob, generator=generator)
        out.bits, out.input_bits = q.bits, q.input_bits
    return out


def understanding_segment(cfg: VisionConfig, pixels_CTHW: torch.Tensor, cnn_CThw: torch.Tensor) -> Segment:
    """The merged-embedding positions of one image or clip (one bidirectional block, no loss)."""
    n_frames = pixels_CTHW.shape[1]
    lay = und_layout(cfg, n_frames)
    return Segment(
        "video" if n_frames > 1 else "image",
        und=VisionUnd(pixels_CTHW, cnn_CThw),
        n_positions=lay["positions"].shape[1],
        positions=lay["positions"],
        block_ids=lay["block_ids"],
    )


def _prev_frame_inputs(tokenizer, input_bits: list[torch.Tensor], cfg: VisionConfig) -> torch.Tensor:
    """(T, n0, n0, D): the accumulated previous frame, area-downsampled to the first scale."""
    from ernie5.tokenizers.vision_quant import area_downsample

    f_hat = tokenizer.codes_to_fhat([b[None] for b in input_bits])[0]  # (D, T, h, w)
    n0 = cfg.scales[0]
    down = area_downsample(f_hat.permute(1, 0, 2, 3), n0)  # (T, D, n0, n0)
    return down.permute(0, 2, 3, 1)


@torch.no_grad()
def generation_inputs(
    tokenizer, cfg: VisionConfig, input_bits: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (frame-major, scale-minor): the VAR inputs ``(P, D)`` and the start flags."""
    n_frames = input_bits[0].shape[0]
    per_scale = tokenizer.scale_inputs([b[None] for b in input_bits])  # list of (1, T, n, n, D)
    prev = _prev_frame_inputs(tokenizer, input_bits, cfg) if n_frames > 1 else None
    rows, starts = [], []
    for f in range(n_frames):
        for k, n in enumerate(cfg.scales):
            x = per_scale[k][0, f].reshape(n * n, -1)
            start = torch.zeros(n * n, dtype=torch.bool)
            if k == 0:
                if f == 0:
                    start[:] = True  # learned start embedding
                else:
                    x = prev[f - 1].reshape(n * n, -1)  # the previous frame's accumulated map
            rows.append(x)
            starts.append(start)
    return torch.cat(rows), torch.cat(starts)


def generation_segment(
    tokenizer, cfg: VisionConfig, bits: list[torch.Tensor] | None, input_bits: list[torch.Tensor]
) -> Segment:
    """NFSP positions of one item: ``bits`` / ``input_bits`` per scale ``(T, n, n, D)``."""
    n_frames = input_bits[0].shape[0]
    lay = nfsp_layout(cfg, n_frames)
    inputs, start = generation_inputs(tokenizer, cfg, input_bits)
    targets = None
    if bits is not None:
        targets = torch.cat(
            [
                bits[k][f].reshape(-1, bits[k].shape[-1])
                for f in range(n_frames)
                for k in range(len(cfg.scales))
            ]
        )
        targets = (targets > 0).float()
    return Segment(
        "video" if n_frames > 1 else "image",
        gen=VisionGen(inputs, lay["scale"], start, targets, scale_loss_weights(cfg, n_frames), lay["cell"]),
        positions=lay["positions"],
        block_ids=lay["block_ids"],
    )


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of a generation prompt as training and evaluation both lay it out (a newline ends it)."""
    return tokenizer.encode(prompt + "\n")


def media_markers(n_frames: int) -> tuple[int, int]:
    """(begin, end) special tokens of an image (BOI/EOI) or a clip (BOV/EOV)."""
    return (BOV, EOV) if n_frames > 1 else (BOI, EOI)


def media_document(
    segment: Segment,
    kind: str,
    n_frames: int,
    prompt: list[int],
    answer: list[int],
    *,
    context: list[int] | tuple[int, ...] = (),
) -> list[Segment]:
    """The segments of one image or clip document, as every consumer lays it out.

    ``kind == "gen"``: ``BOS <prompt> BOI|BOV <segment> EOI|EOV EOS`` (``prompt`` may be empty, the
    classifier-free-guidance dropout); otherwise (understanding): ``BOS BOI|BOV <segment> EOI|EOV``
    then ``answer`` (question and answer ids) with EOS, in the image or video modality.

    ``context``: ids without loss before the scored text (instruction tuning): for understanding
    between EOI|EOV and ``answer`` (the question cue; BOI|BOV then carry no loss either), for
    generation right after BOS (an untargeted prompt; ``prompt`` then usually empty). Empty (the
    default) adds no segment.
    """
    begin, end = media_markers(n_frames)
    if kind == "gen":
        if context:
            head = [context_segment("text", [BOS, *context]), text_segment([*prompt, begin])]
        else:
            head = [text_segment([BOS, *prompt, begin])]
        return [*head, segment, text_segment([end, EOS])]
    modality = "video" if n_frames > 1 else "image"
    answer_seg = Segment(modality, token_ids=torch.tensor([*answer, EOS]))
    if context:  # the whole document before the answer is context, the begin marker included
        head, cue = context_segment("text", [BOS, begin]), [context_segment(modality, context)]
    else:
        head, cue = text_segment([BOS, begin]), []
    return [head, segment, text_segment([end], loss=False), *cue, answer_seg]
