"""Checkpoint-level conveniences behind ``ernie5 generate`` and ``ernie5 extract``."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from ernie5.checkpoint import CheckpointError, load_checkpoint, resolve_checkpoint, save_checkpoint
from ernie5.data import procedural
from ernie5.extract import compute_importance, extract_subnet, extraction_meta
from ernie5.generate import generate, speculative_generate
from ernie5.model.elastic import SubnetSpec, parse_subnet, resolve
from ernie5.params import count_params
from ernie5.tokenizers.special import BOS, EOS


def calibration_batches(
    tokenizer, data_dir: str | Path | None = None, n: int = 4, seq_len: int = 128
) -> list[torch.Tensor]:
    """Token batches for importance calibration: the seeded procedural documents, plus the
    training part of Tiny Shakespeare when the data root has it."""
    rng = random.Random("calibration")
    texts = [procedural.procedural_document(rng) for _ in range(n * 2)]
    try:
        from ernie5.data import text as text_data

        train, _ = text_data.shakespeare_split(text_data.read_shakespeare(data_dir))
        texts += [train[i * 5000 : i * 5000 + 2000] for i in range(n)]
    except Exception:  # noqa: BLE001 - calibration text is optional
        pass
    ids = [[BOS, *tokenizer.encode(t), EOS][:seq_len] for t in texts]
    width = min(len(x) for x in ids)
    return [torch.tensor([x[:width] for x in ids[i : i + 2]]) for i in range(0, len(ids) - 1, 2)]


def _needs_importance(spec: SubnetSpec) -> bool:
    return (spec.depth is not None and spec.layers == "importance") or (
        spec.width is not None and spec.experts == "importance"
    )


def load_subnet(checkpoint: str | Path, subnet: str | None, data_dir=None):
    """Load a checkpoint and resolve ``subnet`` against it (calibrating importance if asked)."""
    ckpt = load_checkpoint(resolve_checkpoint(checkpoint))
    spec = parse_subnet(subnet)
    importance = None
    if _needs_importance(spec):
        if ckpt.tokenizer is None:
            raise CheckpointError(f"{ckpt.path}: importance selection needs the checkpoint's tokenizer")
        importance = compute_importance(ckpt.model, calibration_batches(ckpt.tokenizer, data_dir))
    return ckpt, resolve(spec, ckpt.cfg, importance)


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
    """Generate a continuation of ``prompt``; returns the text and decoding stats."""
    ckpt, sub = load_subnet(checkpoint, subnet)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"{ckpt.path}: no tokenizer.json, cannot encode a text prompt")
    model = ckpt.model.eval()
    ids = [BOS, *ckpt.tokenizer.encode(prompt)]
    info: dict = {"subnet": sub.name}
    if speculative:
        if temperature > 0:
            raise CheckpointError("--speculative decodes greedily; drop --temperature")
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


def extract_checkpoint(checkpoint: str | Path, subnet: str, out: str | Path, data_dir=None) -> dict:
    """Slice ``subnet`` out of ``checkpoint`` into a new checkpoint folder ``out``."""
    ckpt, sub = load_subnet(checkpoint, subnet, data_dir)
    child = extract_subnet(ckpt.model, sub)
    meta = {
        "step": ckpt.meta.get("step"),
        "git_hash": ckpt.meta.get("git_hash"),
        "subnet": extraction_meta(sub, ckpt.cfg),
        "parent": str(ckpt.path),
    }
    path = save_checkpoint(
        out,
        child,
        tokenizer=ckpt.tokenizer,
        meta=meta,
        vision_tokenizer=ckpt.vision_tokenizer,
        refiner=ckpt.refiner,
    )

    def size(p: Path) -> int:
        return (p / "model.safetensors").stat().st_size

    parent_params = count_params(ckpt.cfg)
    child_params = count_params(child.cfg)
    return {
        "out": str(path),
        "subnet": sub.name,
        "parent_total_params": parent_params.total_params,
        "total_params": child_params.total_params,
        "active_params": child_params.active_params,
        "parent_file_bytes": size(ckpt.path),
        "file_bytes": size(path),
    }
