"""Uniform weight averaging of fine-tuned runs that share one starting point (a "model soup").

Runs that branch from the same checkpoint and differ only in a few choices (here: the anneal's data
mix) stay in one basin of the loss, so the mean of their weights is a model in its own right, usually
as good as the best branch on each task it was tuned for. The reference recipe anneals its backbone
twice, on two data mixes, and ships their soup (:mod:`jobs.recipe`).

References:
    Wortsman et al., 2022, "Model soups: averaging weights of multiple fine-tuned models improves
    accuracy without increasing inference time" (the uniform soup, their Eq. 1).

Deviations:
    1. Only the uniform soup: no greedy soup (it needs a held-out split to choose ingredients, and the
       recipe has no split it does not also report).
    2. Floating-point buffers (the router's load-balancing bias) are averaged like parameters; other
       buffers must be equal in every ingredient and are taken as they are.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def uniform_soup(state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of ``state_dicts`` (same keys, shapes and dtypes), computed in fp32
    and returned in each tensor's own dtype; a non-floating tensor must be equal in all of them."""
    if not state_dicts:
        raise ValueError("uniform_soup: expected at least one state dict, got none")
    first = state_dicts[0]
    for i, sd in enumerate(state_dicts[1:], start=1):
        if sd.keys() != first.keys():
            diff = sorted(set(sd.keys()) ^ set(first.keys()))
            raise ValueError(f"uniform_soup: ingredient {i} has different keys from ingredient 0: {diff[:5]}")
    out: dict[str, torch.Tensor] = {}
    for key, ref in first.items():
        tensors = [sd[key] for sd in state_dicts]
        for i, t in enumerate(tensors):
            if t.shape != ref.shape or t.dtype != ref.dtype:
                raise ValueError(
                    f"uniform_soup: {key!r} in ingredient {i} is {tuple(t.shape)} {t.dtype}, "
                    f"expected {tuple(ref.shape)} {ref.dtype} as in ingredient 0"
                )
        if ref.is_floating_point():
            mean = torch.stack([t.detach().float() for t in tensors]).mean(dim=0)
            out[key] = mean.to(ref.dtype)
        else:
            for i, t in enumerate(tensors[1:], start=1):
                if not torch.equal(t, ref):
                    raise ValueError(
                        f"uniform_soup: {key!r} (a {ref.dtype} tensor) differs in ingredient {i}"
                    )
            out[key] = ref.clone()
    return out
