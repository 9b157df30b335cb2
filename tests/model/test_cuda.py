"""The model on a CUDA device: the same functions as on CPU (skipped where no GPU is present).

CI has no GPU, so these run only where one is (``pytest tests/model/test_cuda.py`` on a CUDA
machine). They pin what the CPU tests cannot: the eager model and the fast paths
(:func:`ernie5.fast.apply_fast_paths`: routing, the ``sorted`` / ``grouped`` / ``gather`` expert
paths and the grouped SwiGLU's backward, compiled ``flex_attention``), the KV cache, generation
and sub-model extraction, each on the GPU and against the CPU result (the eager MoE layer's
experts are the reference loop).
"""

from __future__ import annotations

import copy

import pytest
import torch

from ernie5.fast import apply_fast_paths
from ernie5.fast.moe import FastMoE
from ernie5.generation.text import generate, speculative_generate
from ernie5.model.config import MoEConfig
from ernie5.model.inputs import Inputs, Targets
from ernie5.model.model import Ernie5Model
from ernie5.model.moe import MoE
from ernie5.subnets.extract import extract_subnet
from ernie5.subnets.spec import resolve
from tests.conftest import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
PATHS = ("sorted", "grouped", "loop")
"""The expert paths forced on a :class:`FastMoE` copy of the eager layer."""


def _layer(n_experts=8, d_expert=16, top_k=2, d_model=32, **kw):
    layer = MoE(d_model, MoEConfig(n_experts=n_experts, d_expert=d_expert, top_k=top_k, **kw))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return layer


def _fast(layer: MoE, path: str) -> FastMoE:
    """A copy of the eager ``layer`` with its fast forward, on the expert path ``path``."""
    return apply_fast_paths(copy.deepcopy(layer), moe_path=path)


def _fwd_bwd(layer, x, autocast=False, **kw):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        y, r = layer(x, **kw)
    (y.float() * torch.linspace(-1, 1, y.numel(), device=y.device).view_as(y)).sum().backward()
    grads = [x.grad] + [p.grad for p in (layer.router.weight, layer.w13, layer.w2)]
    return y.detach().float(), [g.float() for g in grads], r


@pytest.mark.parametrize("tokens", [5, 64, 300])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_moe_sorted_matches_loop_on_cuda_and_cpu_fp32(tokens, score_func):
    cpu = _layer(score_func=score_func)
    gpu = _layer(score_func=score_func).to(CUDA)
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randn(1, tokens, 32)
    y_ref, g_ref, r_ref = _fwd_bwd(cpu, x)  # the eager layer: the reference loop
    for layer in (gpu, *(_fast(gpu, path) for path in PATHS)):
        y, g, r = _fwd_bwd(layer, x.to(CUDA))
        assert torch.equal(r.counts_E.cpu(), r_ref.counts_E)
        torch.testing.assert_close(y.cpu(), y_ref, atol=1e-5, rtol=1e-4)
        for a, b in zip(g, g_ref):
            torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("autocast", [False, True])
def test_moe_sorted_matches_loop_on_cuda_bf16(autocast):
    layer = _layer(n_experts=16, d_expert=64, d_model=64).to(CUDA)
    if not autocast:
        layer = layer.to(torch.bfloat16)
    x = torch.randn(4, 128, 64, device=CUDA, dtype=torch.float32 if autocast else torch.bfloat16)
    y_loop, g_loop, _ = _fwd_bwd(layer, x, autocast)
    for path in ("sorted", "grouped"):
        y, g, _ = _fwd_bwd(_fast(layer, path), x, autocast)
        # bf16 sums in another order: compare whole tensors by relative norm, not every element
        for a, b in zip([y, *g], [y_loop, *g_loop]):
            assert float((a - b).norm() / b.norm()) < 1e-2, path


def test_moe_skewed_routing_masked_width_and_top_k_on_cuda():
    layer = _layer(n_experts=16).to(CUDA)
    with torch.no_grad():
        layer.router_bias[3] = 5.0  # every token's first choice: one deep level plus overflow
    mask = torch.zeros(16, dtype=torch.bool, device=CUDA)
    mask[::2] = True
    mask[3] = True
    x = torch.randn(2, 200, 32, device=CUDA)
    for kw in ({}, {"expert_mask_E": mask}, {"top_k": 1}):
        y_loop, g_loop, r = _fwd_bwd(layer, x, **kw)
        if "expert_mask_E" in kw:
            assert int(r.counts_E[~mask].sum()) == 0
        for path in ("sorted", "grouped"):
            y, g, _ = _fwd_bwd(_fast(layer, path), x, **kw)
            torch.testing.assert_close(y, y_loop, atol=1e-5, rtol=1e-4)
            for a, b in zip(g, g_loop):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_auto_expert_path_on_cuda_is_grouped_for_bf16_batches_and_gather_for_decoding():
    layer = _fast(_layer().to(CUDA), "auto")
    bf16 = torch.empty(64, 32, device=CUDA, dtype=torch.bfloat16)
    assert layer.expert_path(bf16, 2, torch.bfloat16) == "grouped"
    f32 = bf16.float()
    assert layer.expert_path(f32, 2, torch.float32) == "sorted"  # fp32: grouped_mm has no fast kernel
    assert layer.expert_path(f32, 2, torch.bfloat16) == "grouped"  # under autocast
    with torch.no_grad():
        assert layer.expert_path(bf16, 2, torch.bfloat16) == "grouped"
        assert layer.expert_path(bf16[:2], 2, torch.bfloat16) == "gather"


def test_gather_path_matches_loop_on_cuda():
    layer = _layer().to(CUDA).eval()
    x = torch.randn(1, 3, 32, device=CUDA)
    with torch.no_grad():
        a, _ = _fast(layer, "gather")(x)
        b, _ = layer(x)  # the eager layer: the reference loop
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _pair(fast: bool = True, **cfg):
    """The same model on the CPU and on the GPU; ``fast``: both with :func:`apply_fast_paths`."""
    torch.manual_seed(0)
    cpu = Ernie5Model(tiny_config(**cfg)).eval()
    gpu = Ernie5Model(tiny_config(**cfg)).eval().to(CUDA)
    gpu.load_state_dict(cpu.state_dict())
    if fast:
        apply_fast_paths(cpu)
        apply_fast_paths(gpu)
    return cpu, gpu


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("subnet", [None, "d0.5-w0.5-k1"])
def test_model_loss_and_gradients_on_cuda_match_cpu(subnet, fast):
    cpu, gpu = _pair(fast)
    x = torch.randint(0, 64, (2, 24))
    doc = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    results = []
    for m in (cpu, gpu):
        dev = m.tok_emb.weight.device
        sub = resolve(subnet, m.cfg) if subnet else None
        inputs = Inputs(x[:, :-1].to(dev), doc_ids_BT=doc[:, :-1].to(dev))
        out = m(inputs, targets=Targets(x[:, 1:].to(dev)), subnet=sub)
        loss = out.losses.text + sum(out.losses.mtp)
        loss.backward()
        results.append(
            (out.logits_BTV.detach().cpu(), loss.detach().cpu(), {n: p.grad for n, p in m.named_parameters()})
        )
    (la, sa, ga), (lb, sb, gb) = results
    torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sb, sa, atol=1e-5, rtol=1e-5)
    assert ga.keys() == gb.keys()
    for name in ga:
        if ga[name] is None:
            assert gb[name] is None, name
        else:
            torch.testing.assert_close(gb[name].cpu(), ga[name], atol=1e-4, rtol=1e-3, msg=name)


def test_training_steps_on_cuda_lower_the_loss():
    torch.manual_seed(0)
    m = apply_fast_paths(Ernie5Model(tiny_config()).to(CUDA).train())
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 33), device=CUDA)
    losses = []
    for _ in range(30):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = m(x[:, :-1], targets=x[:, 1:]).losses.text
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.7 * losses[0]


def test_compiled_flex_attention_on_cuda_matches_sdpa():
    torch.manual_seed(1)
    cfg = dict(d_model=64, n_heads=4, n_kv_heads=2)  # head_dim 16: the compiled kernel's minimum
    sd = Ernie5Model(tiny_config(**cfg)).eval().to(CUDA)  # eager SDPA: the reference
    fx = Ernie5Model(tiny_config(attn_impl="flex", **cfg)).eval().to(CUDA)
    fx.load_state_dict(sd.state_dict())
    apply_fast_paths(fx)  # FastAttention compiles flex_attention on CUDA
    x = torch.randint(0, 64, (2, 16), device=CUDA)
    doc = torch.tensor([[0] * 9 + [1] * 7, [0] * 16], device=CUDA)
    blk = torch.tensor([[0, 1, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 8, 8, 9], list(range(16))], device=CUDA)
    inputs = Inputs(x, doc_ids_BT=doc, block_ids_BT=blk)
    with torch.no_grad():
        a = sd(inputs).logits_BTV
        b = fx(inputs).logits_BTV
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fast", [False, True])
def test_kv_cache_decode_equals_full_forward_on_cuda(fast):
    _, m = _pair(fast)
    x = torch.randint(0, 64, (2, 16), device=CUDA)
    with torch.no_grad():
        full = m(x).logits_BTV
        cache = m.new_cache(2, 32)
        outs, at = [], 0
        for n in (10, 1, 1, 4):
            outs.append(m(x[:, at : at + n], cache=cache).logits_BTV)
            at += n
    torch.testing.assert_close(torch.cat(outs, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("subnet", [None, "d0.5-k1"])
def test_generation_on_cuda_equals_cpu_and_speculative_equals_greedy(subnet):
    cpu, gpu = _pair()
    for m in (cpu, gpu):
        with torch.no_grad():
            m.head.weight.mul_(20)  # no near-ties between devices
    prompts = [[1, 5, 7, 9], [3, 4]]
    sub = resolve(subnet, cpu.cfg) if subnet else None
    on_gpu = generate(gpu, prompts, 16, subnet=sub)
    assert on_gpu == generate(cpu, prompts, 16, subnet=sub)
    spec, _ = speculative_generate(gpu, prompts[0], 16, subnet=sub)
    assert spec == on_gpu[0]


def test_sampled_generation_on_cuda_draws_what_the_cpu_draws():
    """The uniform draws come from generate's CPU generator wherever the model runs."""
    cpu, gpu = _pair()
    for m in (cpu, gpu):
        with torch.no_grad():
            m.head.weight.mul_(3)  # peaked enough that the devices' rounding moves no draw
    prompts = [[1, 5, 7, 9], [3, 4]]
    on_gpu = generate(gpu, prompts, 12, temperature=1.0, seed=5)
    assert on_gpu == generate(gpu, prompts, 12, temperature=1.0, seed=5)
    assert on_gpu == generate(cpu, prompts, 12, temperature=1.0, seed=5)


def test_extracted_subnet_on_cuda_equals_masked_forward():
    _, m = _pair()
    sub = resolve("d0.5-w0.5-k1", m.cfg)
    child = extract_subnet(m, sub).eval()
    assert child.tok_emb.weight.device.type == "cuda"
    x = torch.randint(0, 64, (2, 12), device=CUDA)
    with torch.no_grad():
        a = m(x, subnet=sub).logits_BTV
        b = child(x).logits_BTV
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
