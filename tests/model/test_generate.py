"""Generation: batched == one by one, MTP self-speculative == greedy."""

from __future__ import annotations

import pytest
import torch

from ernie5.fast import apply_fast_paths
from ernie5.generation.text import generate, speculative_generate
from ernie5.model.model import Ernie5Model
from ernie5.subnets.spec import resolve
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
    # the prefill, then one verifying forward per draft; an accepted draft is one token for free
    assert stats.forwards == 1 + stats.drafted and 0 <= stats.accepted <= stats.drafted
    assert stats.drafted + stats.accepted >= len(greedy) - 1


def _successor_model() -> Ernie5Model:
    """A model whose backbone and MTP head both provably say ``(t + 1) mod V`` after token ``t``.

    * Every block's output projections (attention ``wo``, the experts' and dense FFNs' ``w2``) are
      zero, so each block is the identity on the residual stream: the backbone's hidden state at a
      position is its own token's embedding ``e_t``, whatever the prefix.
    * The embedding rows have one norm and pairwise distinct directions, and the head's row for
      ``(s + 1) mod V`` is ``e_s``: the logit of ``s + 1`` is ``<RMSNorm(e_t), e_s>``, which is
      largest exactly at ``s = t`` (Cauchy-Schwarz; the norm weights are 1).
    * The MTP projection is ``[0 | I]``: it passes on ``RMSNorm(Emb(t_{n+1}))``, its block is the
      identity too, and the shared head drafts ``t_{n+1} + 1``, which is what the backbone says
      after ``t_{n+1}``: the draft of a copy of the backbone's rule.
    """
    torch.manual_seed(0)
    m = Ernie5Model(tiny_config()).eval()
    v, d = m.cfg.vocab_size, m.cfg.d_model
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("wo.weight", "w2.weight", "ffn.w2")):
                p.zero_()
        emb = torch.nn.functional.normalize(torch.randn(v, d), dim=-1)
        m.tok_emb.weight.copy_(emb)
        m.head.weight.copy_(emb.roll(1, dims=0))  # row s + 1 is e_s
        m.mtp[0].proj.weight.copy_(torch.cat([torch.zeros(d, d), torch.eye(d)], dim=1))
    return m


@pytest.mark.parametrize("fast", [False, True])
def test_speculative_accepts_every_draft_of_a_copying_mtp(fast):
    """When the MTP head predicts what the backbone will say, every draft is accepted."""
    m = _successor_model()
    if fast:
        apply_fast_paths(m)
    prompt = [5, 6, 7]
    with torch.no_grad():  # the construction holds: each block is the identity, the head says t + 1
        out = m(torch.tensor([prompt]))
        assert torch.equal(out.hidden_BTD[0], m.tok_emb.weight[prompt])
        assert out.logits_BTV[0].argmax(-1).tolist() == [6, 7, 8]
    greedy = generate(m, [prompt], 10)[0]
    assert greedy == [(8 + i) % m.cfg.vocab_size for i in range(10)]
    spec, stats = speculative_generate(m, prompt, 10)
    assert spec == greedy
    assert stats.drafted > 0 and stats.accepted == stats.drafted and stats.acceptance_rate == 1.0
    # every verifying forward yields two tokens: the prefill gives the first, five forwards the rest
    assert stats.drafted == 5 and stats.forwards == 6


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
    from ernie5.generation.text import sample_categorical

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
