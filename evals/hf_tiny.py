"""Tiny Hugging Face MoE folders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) for tests and the offline demo.

``python -m evals.hf_tiny OUT [--family mixtral] [--steps 300]`` writes a randomly initialised tiny MoE
causal LM with ``save_pretrained`` and a byte-level BPE tokenizer (ERNIE5's
:class:`~ernie5.tokenizers.text.TextTokenizer`, trained on the seeded procedural documents, wrapped in
``PreTrainedTokenizerFast``), then trains it for ``--steps`` Adam steps on the procedural documents
(the text the smoke tasks ask about), so that ``ernie5 nightly --checkpoint hf:OUT --suite
suites/hf_text.yaml`` has a seesaw to show. No real open MoE is available offline; this folder only
exercises the path.

References:
  * transformers 5 ``MixtralConfig``, ``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``OlmoeConfig``.

Deviations:
  1. The tokenizer loaded by transformers matches special-token strings in raw text (ERNIE5's loader
     does not, :mod:`ernie5.tokenizers.text` Deviations 2); the procedural text never contains them.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def tiny_config(family: str, vocab_size: int, *, layers: int = 4, experts: int = 8, hidden: int = 64):
    """A tiny config of ``family`` (2 routed experts per token)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        num_experts_per_tok=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return MixtralConfig(**common, intermediate_size=2 * hidden, num_local_experts=experts)
    moe = dict(num_experts=experts, moe_intermediate_size=hidden, intermediate_size=2 * hidden)
    if family == "qwen2_moe":
        return Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=hidden, norm_topk_prob=False)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, **moe, head_dim=hidden // 4, norm_topk_prob=True)
    if family == "olmoe":
        return OlmoeConfig(
            **{**common, "intermediate_size": hidden}, num_experts=experts, norm_topk_prob=False
        )
    raise ValueError(f"family {family!r} is not one of {', '.join(FAMILIES)}")


def procedural_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` seeded procedural documents (arithmetic, copy, reverse, sort)."""
    from ernie5.data import procedural

    rng = random.Random(seed)
    return [procedural.procedural_document(rng) for _ in range(n)]


def tiny_tokenizer(vocab_size: int = 384):
    """A ``PreTrainedTokenizerFast`` over a BPE trained on procedural documents (ERNIE5 special ids)."""
    from transformers import PreTrainedTokenizerFast

    from ernie5.tokenizers.text import TextTokenizer

    tok = TextTokenizer.train(procedural_texts(300, seed=1), vocab_size)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok._tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def train_briefly(model, tokenizer, steps: int, seed: int = 0, seq_len: int = 128, batch: int = 8) -> float:
    """``steps`` Adam steps of next-token prediction on procedural documents; the last loss."""
    torch.manual_seed(seed)
    ids = []
    for text in procedural_texts(steps * batch // 2 + batch, seed=seed + 2):
        ids += [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False)]
    stream = torch.tensor(ids)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50) * (1 - s / (steps + 1)))
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = torch.randint(0, len(stream) - seq_len - 1, (batch,))
        x = torch.stack([stream[s : s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return float(loss)


def write_tiny(out: str | Path, family: str = "mixtral", steps: int = 0, seed: int = 0, **shape) -> Path:
    """Write a tiny ``family`` model and its tokenizer to ``out`` (trained ``steps`` steps)."""
    from transformers import AutoModelForCausalLM

    out = Path(out)
    tokenizer = tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, len(tokenizer), **shape))
        loss = train_briefly(model, tokenizer, steps, seed) if steps else None
    model.eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"family": family, "steps": steps, "seed": seed, "final_loss": loss, "data": "procedural"}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m evals.hf_tiny OUT [--family F] [--steps N] [--seed S]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to write")
    p.add_argument("--family", default="mixtral", choices=FAMILIES)
    p.add_argument("--steps", type=int, default=300, help="brief training steps (0: random init)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_tiny(args.out, args.family, args.steps, args.seed))


if __name__ == "__main__":
    main()
