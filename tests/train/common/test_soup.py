"""The uniform soup: the element-wise mean of its ingredients, against a naive loop."""

from __future__ import annotations

import pytest
import torch

from train.common.soup import uniform_soup


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=g),
        "half": torch.randn(5, generator=g).to(torch.bfloat16),
        "steps": torch.tensor([7, 9]),
    }


def test_the_soup_is_the_mean_of_its_ingredients_in_each_tensors_dtype():
    states = [_state(s) for s in range(3)]
    soup = uniform_soup(states)
    for key in ("w", "half"):
        naive = torch.zeros(states[0][key].shape)
        for sd in states:
            naive += sd[key].float() / len(states)
        assert soup[key].dtype == states[0][key].dtype
        torch.testing.assert_close(soup[key].float(), naive.to(states[0][key].dtype).float())
    assert torch.equal(soup["steps"], states[0]["steps"])
    one = uniform_soup([states[1]])
    assert all(torch.equal(one[k], states[1][k]) for k in states[1])


def test_ingredients_that_do_not_match_are_refused_with_the_key_named():
    a, b = _state(0), _state(1)
    with pytest.raises(ValueError, match="different keys"):
        uniform_soup([a, {k: v for k, v in b.items() if k != "w"}])
    with pytest.raises(ValueError, match=r"'w' in ingredient 1 is \(4, 3\)"):
        uniform_soup([a, {**b, "w": b["w"].T.contiguous()}])
    with pytest.raises(ValueError, match="'steps'.*differs in ingredient 1"):
        uniform_soup([a, {**b, "steps": torch.tensor([7, 8])}])
    with pytest.raises(ValueError, match="at least one"):
        uniform_soup([])
