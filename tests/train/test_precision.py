import torch
from torch import nn

from train.precision import MixedPrecision


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


def test_sync_copies_master_into_replica():
    master = _net()
    mp = MixedPrecision(master, "bf16")
    with torch.no_grad():
        for p in master.parameters():
            p.add_(1.0)
    mp.sync()
    for m, c in zip(master.parameters(), mp.compute.parameters()):
        assert c.dtype == torch.bfloat16 and torch.equal(c, m.bfloat16())


def test_fp32_is_a_no_op_pair():
    master = _net()
    mp = MixedPrecision(master, "fp32")
    assert mp.compute is master
    mp.compute(torch.randn(2, 8)).sum().backward()
    grads = [p.grad.clone() for p in master.parameters()]
    mp.accumulate_grads()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, master.parameters()))
