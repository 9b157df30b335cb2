"""A non-finite loss or gradient: the step is skipped (nothing learned, noted in metrics.jsonl), the run
stops by its policy with one line and exit 4, and no checkpoint of non-finite weights is ever written."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from jobs.cli import main
from train.common.nonfinite import DivergedError, NonFinitePolicy, first_nonfinite, loss_problem
from train.pretrain.config import RunConfig
from train.pretrain.loop import Trainer, pretrain
from train.pretrain.precision import MixedPrecision

MICRO = ["data.tokenizer_chars=20000", "train.log_every=1"]


def _events(run) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("event")]


def test_the_divergent_run_ends_in_one_line_with_a_loadable_checkpoint(tmp_path, capsys):
    """The issue's run (lr 1e6): nan losses for the rest of the run, then a traceback and no checkpoint
    before; now exit 4, one line naming the step, the quantity and the last good checkpoint."""
    out = tmp_path / "run"
    args = ["train", "--config", "micro", "--out", str(out), "--quiet"]
    for item in [*MICRO, "optim.lr=1e6", "train.steps=40", "train.ckpt_every=1"]:
        args += ["--set", item]
    assert main(args) == 4
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ernie5 train: diverged: step "), err
    assert "non-finite" in err[0] and "5 steps in a row" in err[0] and "last good checkpoint: " in err[0]
    named = err[0].rsplit("last good checkpoint: ", 1)[1]
    ckpt = load_checkpoint(named, fast=False)  # loadable, and finite
    assert first_nonfinite(ckpt.model.named_parameters()) is None
    assert all(first_nonfinite(ckpt.model.named_parameters()) is None for _ in checkpoint_dirs(out))
    events = _events(out)
    assert len(events) == 5 and all(e["event"] == "nonfinite" for e in events)
    assert [e["step"] for e in events] == list(range(events[0]["step"], events[0]["step"] + 5))


def test_a_single_bad_step_is_skipped_and_the_run_finishes(tmp_path, monkeypatch):
    cfg = load(RunConfig, resolve_config_path("micro"), [*MICRO, "train.steps=6", "train.ckpt_every=3"])
    real = Trainer._micro_step
    seen = {}

    def poisoned(self, step, micro, weights):
        out = real(self, step, micro, weights)
        if step == 3:  # the fourth step's loss is nan
            seen["before"] = {k: v.clone() for k, v in self.model.state_dict().items()}
            out = {**out, "total": math.nan}
        if step == 4 and "after" not in seen:
            seen["after"] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return out

    monkeypatch.setattr(Trainer, "_micro_step", poisoned)
    pretrain(cfg, tmp_path / "run", quiet=True)
    assert _events(tmp_path / "run") == [{"step": 4, "event": "nonfinite", "what": "loss (total=nan)"}]
    assert all(torch.equal(seen["before"][k], seen["after"][k]) for k in seen["before"])  # nothing learned
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]  # 4 as its event, the rest as records
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")][-1] == "step_00000006"


def test_stop_stops_at_the_first_and_a_nan_gradient_is_named(tmp_path, monkeypatch):
    cfg = load(RunConfig, resolve_config_path("micro"), [*MICRO, "train.steps=6", "train.nonfinite=stop"])
    real = Trainer._micro_step

    def nan_grad(self, step, micro, weights):
        out = real(self, step, micro, weights)
        if step == 1:
            for p in (*self.compute.parameters(), *self.model.parameters()):
                if p.grad is not None:
                    p.grad.fill_(math.nan)
                    break
        return out

    monkeypatch.setattr(Trainer, "_micro_step", nan_grad)
    with pytest.raises(
        DivergedError,
        match=r"step 2: non-finite gradient norm \(nan; first in .+\) \(train.nonfinite=stop\); no ",
    ):
        pretrain(cfg, tmp_path / "run", quiet=True)


def test_precision_step_skips_a_nonfinite_gradient_and_leaves_the_optimizer_alone():
    torch.manual_seed(0)
    for dtype in ("bf16", "fp32"):
        model = torch.nn.Linear(4, 3)
        prec = MixedPrecision(model, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        prec.compute(torch.randn(2, 4, dtype=next(prec.compute.parameters()).dtype)).sum().backward()
        prec.accumulate_grads(only_micro_batch=True)
        for p in (*prec.compute.parameters(), *model.parameters()):
            if p.grad is not None:
                p.grad.view(-1)[0] = math.inf
        norm = prec.step(opt, 1.0, skip_nonfinite=True)
        assert not math.isfinite(norm)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert not opt.state  # no moment was touched
        prec.discard_grads()
        assert all(p.grad is None for p in (*prec.compute.parameters(), *model.parameters()))
        prec.compute(torch.randn(2, 4, dtype=next(prec.compute.parameters()).dtype)).sum().backward()
        prec.accumulate_grads(only_micro_batch=True)
        assert math.isfinite(prec.step(opt, 0.0, skip_nonfinite=True))  # computed even with clipping off
        assert not torch.equal(before["weight"], model.weight)


def test_policy_and_helpers(tmp_path):
    guard = NonFinitePolicy("skip", 2, tmp_path)
    guard.skipped(1, "loss (text=nan)")
    guard.ok()
    guard.skipped(3, "loss (text=nan)")
    with pytest.raises(DivergedError, match="step 4: .*2 steps in a row, train.nonfinite_patience=2"):
        guard.skipped(4, "loss (text=inf)")
    assert loss_problem({"text": 1.0, "mtp": None, "aux": math.inf}) == "loss (aux=inf)"
    assert loss_problem({"text": 1.0}) is None
    assert first_nonfinite([("a", torch.ones(2)), ("b", torch.tensor([1.0, math.nan]))]) == "b"
