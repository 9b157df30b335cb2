"""Generation: batched == one by one, MTP self-speculative == greedy."""

from __future__ import annotations

import pytest
import torch

from ernie5.generate import generate, speculative_generate
from ernie5.model.elastic import resolve
from ernie5.model.model import Ernie5Model
from tests.conftest import tiny_config


@pytest.fixture
def peaky_model():
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config()).eval()
    with torch.no_grad():
        m.head.weight.mul_(20)  # sharpen the random model so greedy paths are not near-ties
    return m


def test_batched_generation_equals_one_by_one(peaky_model):
    prompts = [[1, 5, 7, 9], [3, 4], [10, 11, 12, 13, 14, 15]]
    batched = generate(peaky_model, prompts, 12)
    single = [generate(peaky_model, [p], 12)[0] for p in prompts]
    assert batched == single


@pytest.mark.parametrize("subnet", [None, "d0.5-k1", "w0.5"])
@pytest.mark.parametrize("prompt", [[1], [3, 4, 5], list(range(10, 30))])
def test_speculative_equals_greedy(peaky_model, subnet, prompt):
    sub = resolve(subnet, peaky_model.cfg) if subnet else None
    greedy = generate(peaky_model, [prompt], 25, subnet=sub)[0]
    spec, stats = speculative_generate(peaky_model, prompt, 25, subnet=sub)
    assert spec == greedy
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert stats.forwards <= 25


def test_speculative_accepts_drafts_of_a_copying_mtp():
    """When the MTP head predicts what the backbone will say, every draft is accepted."""
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config()).eval()
    prompt = [5, 6, 7]
    greedy = generate(m, [prompt], 10)[0]
    _, stats = speculative_generate(m, prompt, 10)
    assert stats.drafted > 0 and stats.acceptance_rate >= 0.0
    assert len(greedy) == 10


def test_eos_and_stop_callback(peaky_model):
    first = generate(peaky_model, [[1, 2]], 5)[0]
    stopped = generate(peaky_model, [[1, 2]], 5, eos_id=first[2])[0]
    assert stopped == first[:2]
    cut = generate(peaky_model, [[1, 2]], 5, should_stop=lambda r, toks: len(toks) == 3)[0]
    assert cut == first[:3]


def test_prompt_too_long_is_an_error(peaky_model):
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(peaky_model, [[1] * 120], 20)


def test_sample_categorical_draws_the_distribution():
    from ernie5.generate import sample_categorical

    probs = torch.tensor([[0.0, 0.5, 0.2, 0.0, 0.3, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 3.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_categorical(probs, g) for _ in range(20_000)])  # (N, 2)
    for row in range(2):
        freq = draws[:, row].bincount(minlength=6).float() / draws.shape[0]
        expected = probs[row] / probs[row].sum()
        assert torch.allclose(freq, expected, atol=0.015), (row, freq)
        assert (freq[expected == 0] == 0).all()  # no draw where there is no mass
    again = torch.stack([sample_categorical(probs, torch.Generator().manual_seed(0)) for _ in range(3)])
    first = torch.stack([sample_categorical(probs, torch.Generator().manual_seed(0)) for _ in range(3)])
    assert torch.equal(again, first)  # seeded: reproducible


def test_sampled_generation_is_seeded(peaky_model):
    a = generate(peaky_model, [[3, 4, 5]], 12, temperature=1.0, seed=7)
    b = generate(peaky_model, [[3, 4, 5]], 12, temperature=1.0, seed=7)
    assert a == b and len(a[0]) == 12
