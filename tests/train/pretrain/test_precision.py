import numpy as np
import pytest
import torch
from torch import nn

from ernie5.kernels import kernels
from train.pretrain.precision import MixedPrecision

needs_kernels = pytest.mark.skipif(kernels() is None, reason="fused CPU kernels did not build here")


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4))


def test_bf16_accumulation_sums_micro_batches_and_reuses_buffers():
    master = _net()
    mp = MixedPrecision(master, "bf16")
    xs = [torch.randn(5, 8) for _ in range(3)]
    expected = [torch.zeros_like(p) for p in master.parameters()]
    for x in xs:
        mp.compute(x.bfloat16()).float().square().sum().backward()
        for e, c in zip(expected, mp.compute.parameters()):
            e.add_(c.grad.float())
        mp.accumulate_grads()
        assert all(c.grad is None for c in mp.compute.parameters())
    for e, m in zip(expected, master.parameters()):
        assert m.grad.dtype == torch.float32
        assert torch.allclose(m.grad, e)
    first = [m.grad.data_ptr() for m in master.parameters()]
    for m in master.parameters():
        m.grad = None  # what optimizer.zero_grad(set_to_none=True) does
    mp.compute(xs[0].bfloat16()).float().sum().backward()
    mp.accumulate_grads()
    assert [m.grad.data_ptr() for m in master.parameters()] == first  # same storage, overwritten
    fresh = [c.grad for c in MixedPrecision(master, "bf16").compute.parameters()]
    assert all(g is None for g in fresh)


def test_sync_copies_master_buffers_into_replica():
    master = _net()
    master.register_buffer("bias_E", torch.zeros(3))
    mp = MixedPrecision(master, "bf16")
    master.bias_E.add_(0.25)
    mp.sync()
    assert torch.equal(mp.compute.bias_E, master.bias_E.bfloat16())


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train(monkeypatch, kernels_setting, max_norm, steps=3, micro_batches=1):
    monkeypatch.setenv("ERNIE5_KERNELS", kernels_setting)
    master = nn.Sequential(_net(), nn.Linear(4, 4))  # the last layer gets no gradient
    mp = MixedPrecision(master, "bf16")
    opt = torch.optim.AdamW(_groups(master), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    torch.manual_seed(1)
    norms = []
    for _ in range(steps):
        for _ in range(micro_batches):
            mp.compute[0](torch.randn(6, 8).bfloat16()).float().square().sum().backward()
            mp.accumulate_grads(only_micro_batch=micro_batches == 1)
        norms.append(mp.step(opt, max_norm))
        opt.zero_grad(set_to_none=True)
        mp.sync()
    return master, mp, opt, norms


@needs_kernels
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e3])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_fused_step_matches_clip_and_step(monkeypatch, max_norm, micro_batches):
    ref_master, ref_mp, ref_opt, ref_norms = _train(monkeypatch, "off", max_norm, micro_batches=micro_batches)
    master, mp, opt, norms = _train(monkeypatch, "auto", max_norm, micro_batches=micro_batches)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-5)
    for (name, p), q in zip(master.named_parameters(), ref_master.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
    for c, p in zip(mp.compute.parameters(), master.parameters()):
        assert torch.equal(c, p.bfloat16())  # the replica is the rounded master
    untouched = master[1].weight
    assert untouched not in opt.state and torch.equal(untouched, ref_master[1].weight)
    # The moments are the optimizer's own state, as torch.optim.AdamW keeps it (checkpoints).
    ref_state, state = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert ref_state.keys() == state.keys()
    for i in state:
        assert state[i].keys() == ref_state[i].keys()
        for key, value in state[i].items():
            assert value.dtype == ref_state[i][key].dtype and value.shape == ref_state[i][key].shape
            torch.testing.assert_close(value, ref_state[i][key], atol=1e-6, rtol=1e-4)


@needs_kernels
def test_fused_step_reads_the_replica_gradient_of_a_single_micro_batch(monkeypatch):
    monkeypatch.setenv("ERNIE5_KERNELS", "auto")
    master = _net()
    mp = MixedPrecision(master, "bf16")
    mp.compute(torch.randn(3, 8).bfloat16()).sum().backward()
    mp.accumulate_grads(only_micro_batch=True)
    assert all(m.grad is None for m in master.parameters())
    assert all(c.grad is not None for c in mp.compute.parameters())
    opt = torch.optim.AdamW(master.parameters(), lr=1e-3, fused=True)
    mp.step(opt, 1.0)
    assert all(c.grad is None for c in mp.compute.parameters()) and len(opt.state) == 4


def test_fp32_is_a_no_op_pair():
    master = _net()
    mp = MixedPrecision(master, "fp32")
    assert mp.compute is master
    mp.compute(torch.randn(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in master.parameters()]
    mp.accumulate_grads()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, master.parameters()))


@needs_kernels
def test_replica_gradients_reach_an_optimizer_the_fused_step_cannot_take(monkeypatch):
    """A single micro-batch leaves its gradients on the replica; a non-fused AdamW still gets them."""
    monkeypatch.setenv("ERNIE5_KERNELS", "auto")
    master = _net()
    before = [p.detach().clone() for p in master.parameters()]
    mp = MixedPrecision(master, "bf16")
    mp.compute(torch.randn(3, 8).bfloat16()).square().sum().backward()
    mp.accumulate_grads(only_micro_batch=True)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, fused=False)
    assert not mp._fusable(opt)
    norm = mp.step(opt, 1.0)
    assert norm > 0 and len(opt.state) == 4
    assert all(not torch.equal(p, b) for p, b in zip(master.parameters(), before))
    for c, m in zip(mp.compute.parameters(), master.parameters()):
        assert c.grad is None and torch.equal(c, m.bfloat16())


@needs_kernels
def test_gradient_norm_reuses_the_expert_kernels_sums_of_squares(monkeypatch):
    """With bf16 MoE experts on the padding-skipping kernels, the fused step takes the expert
    weight gradients' sums of squares from the kernels that computed them, and the norm (so the
    clipped update) matches the one that reads every gradient."""
    from ernie5.fast import apply_fast_paths
    from ernie5.fast.moe import FastMoE
    from ernie5.model.config import MoEConfig
    from ernie5.model.moe import MoE

    if not kernels().expert_gemm_available():
        pytest.skip("the expert GEMM kernels need an AVX512-BF16 build")
    monkeypatch.setenv("ERNIE5_KERNELS", "auto")

    def run(reuse):
        torch.manual_seed(0)
        master = MoE(64, MoEConfig(n_experts=8, d_expert=32, top_k=2))
        for p in master.parameters():
            nn.init.normal_(p, std=0.1)
        mp = MixedPrecision(master, "bf16")
        # what the trainer does: the replica's MoE layers record into the pair's own GradSquares
        apply_fast_paths(mp.compute, grad_squares=mp.grad_squares)
        assert isinstance(mp.compute, FastMoE) and mp.compute.grad_squares is mp.grad_squares
        assert type(master) is MoE  # the master keeps the eager maths
        opt = torch.optim.AdamW(master.parameters(), lr=1e-2, fused=True)
        hits = []
        take = mp.grad_squares.take

        def counted(param, grad):
            got = take(param, grad) if reuse else None
            hits.append(got is not None)
            return got

        monkeypatch.setattr(mp.grad_squares, "take", counted)
        y, _ = mp.compute(torch.randn(2, 40, 64).bfloat16())
        y.float().square().sum().backward()
        mp.accumulate_grads(only_micro_batch=True)
        norm = mp.step(opt, 0.5)
        return norm, hits, [p.detach().clone() for p in master.parameters()]

    norm, hits, params = run(reuse=True)
    ref_norm, ref_hits, ref_params = run(reuse=False)
    assert sum(hits) == 2 and not any(ref_hits)  # w13 and w2 came with their sums
    assert norm == pytest.approx(ref_norm, rel=1e-6)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_each_pair_owns_its_grad_squares():
    """The recorded sums belong to one master/replica pair (no process-wide table): a sum recorded
    for one pair's replica is invisible to another's, and accumulating gradients forgets it."""
    a, b = MixedPrecision(_net(), "bf16"), MixedPrecision(_net(), "bf16")
    assert a.grad_squares is not b.grad_squares
    p, g = a.compute[0].weight, torch.ones(16, 8, dtype=torch.bfloat16)
    a.grad_squares.record(p, g, 128.0)
    assert b.grad_squares.take(p, g) is None
    assert a.grad_squares.take(p, g) == 128.0
    a.grad_squares.record(p, g, 128.0)
    p.grad = g
    a.accumulate_grads()  # the replica's gradient now lives (added) in the master's
    assert a.grad_squares.take(p, g) is None


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_off_the_cpu_the_step_is_torchs_own_and_never_reaches_the_cpu_kernels(monkeypatch, micro_batches):
    """On a GPU (the stand-in device here) the fused C++ kernels are never asked for, so never built
    or handed device tensors: the replica's gradients reach the masters and torch's AdamW steps."""
    import train.pretrain.precision as precision
    from tests.stand_in_device import stand_in_device

    monkeypatch.setenv("ERNIE5_KERNELS", "auto")

    def no_kernels():
        raise AssertionError("the CPU kernels were asked for on the device path")

    monkeypatch.setattr(precision, "kernels", no_kernels)
    ref = _net()
    with stand_in_device() as mixed:
        master = _net().to("meta")
        mp = MixedPrecision(master, "bf16")
        x = torch.randn(3, 8).bfloat16().to("meta")
        for _ in range(micro_batches):
            mp.compute(x).sum().backward()
            mp.accumulate_grads(only_micro_batch=micro_batches == 1)
        assert all(m.grad is not None for m in master.parameters())
        opt = torch.optim.AdamW(master.parameters(), lr=1e-3, foreach=False)  # (fused: no meta kernel)
        mp.step(opt, 1.0)
        moved = [
            float((m.detach().cpu() - r.detach()).abs().max())
            for m, r in zip(master.parameters(), ref.parameters())
        ]
    assert mixed == [] and min(moved) > 0
