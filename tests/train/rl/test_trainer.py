"""The RL loop on a micro checkpoint: routing replay reproduces the rollout's log-probs, a tiny run raises
its reward, a resumed run equals an uninterrupted one, and bad configs are one-line errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from ernie5.config import from_dict, load, to_dict
from ernie5.presets import resolve_config_path
from ernie5.sequence.context import context_document
from ernie5.store.checkpoint import checkpoint_dirs, load_checkpoint
from train.common.run_folder import RunError
from train.pretrain.config import ElasticConfig, RunConfig
from train.pretrain.loop import pretrain
from train.rl.buffer import Rollout
from train.rl.config import ObjectiveConfig, RLLoopConfig, RLRunConfig, RolloutConfig
from train.rl.rollout_text import Prompt, RolloutEngine, rollout_document
from train.rl.trainer import RLTrainer, rl_config


@dataclass(frozen=True)
class ToyQuery:
    context: str
    max_new_tokens: int = 4
    stop: tuple[str, ...] = ("\n",)
    hint: str = " eee"


class ToyVerifier:
    """Reward 1 for a response that contains the letter ``e``: reachable from a barely trained model."""

    name = "toy"
    modality = "text"

    def query(self, index: int, seed: int) -> ToyQuery:
        return ToyQuery(f"Q: word {index % 7}\nA:")

    def reward(self, query: ToyQuery, text: str) -> float:
        return float("e" in text)


@pytest.fixture(scope="module")
def micro_ckpt(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("rl") / "base"
    cfg = load(RunConfig, resolve_config_path("micro"), ["train.steps=10", "data.tokenizer_chars=20000"])
    pretrain(cfg, run, quiet=True)
    return checkpoint_dirs(run)[-1]


def _cfg(ckpt: Path, **sections) -> RLRunConfig:
    model = load_checkpoint(ckpt, fast=False).cfg
    base = RLRunConfig(
        model=model,
        tasks={"toy": 1.0},
        rl=RLLoopConfig(steps=4, init_from=str(ckpt), dtype="fp32", ckpt_every=2),
        rollout=RolloutConfig(queries_per_step=4, group_size=4, chunk=2, pool_size=8),
        objective=ObjectiveConfig(minibatches=2, ahrl=True),
        elastic=ElasticConfig(),  # one sampled sub-model per query group
    )
    return replace(base, **sections)


def test_routing_replay_reproduces_the_rollout_logprobs(micro_ckpt):
    ckpt = load_checkpoint(micro_ckpt)
    model = ckpt.model.eval()
    doc = context_document("Q: 12+34=\nA:", ckpt.tokenizer)
    engine = RolloutEngine(model, ckpt.tokenizer, lambda r: Prompt(doc, 6, ()), temperature=1.0, seed=3)
    rows = [Rollout(0, s) for s in range(3)]
    subnet = __import__("ernie5.model.elastic", fromlist=["Subnet"]).Subnet.full(model.cfg)
    engine.advance(rows, 3, 0, subnet, 0)  # two rounds: the second resumes the partial responses
    engine.advance(rows, 3, 1, subnet, 0)
    for r in rows:
        fed = len(doc[0]) + sum(len(s) for s in doc[1:]) + len(r.tokens) - 1
        assert all(ids.shape[0] == fed for ids in r.routing.values())
        full = rollout_document(Prompt(doc, 6, ()), r)
        ids = torch.tensor([[t for s in full for t in s.token_ids.tolist()]])
        replay = {
            i: torch.cat([v.long(), torch.full((1, v.shape[1]), -1)])[None] for i, v in r.routing.items()
        }
        with torch.no_grad():
            out = model(ids, routing_replay=replay)
        logp = torch.log_softmax(out.logits_BTV[0].float(), -1)
        n = len(r.tokens)
        got = logp[-n - 1 : -1].gather(-1, torch.tensor(r.tokens)[:, None]).squeeze(-1)
        assert torch.allclose(got, torch.tensor(r.logp), atol=1e-5)
        for i, v in r.routing.items():
            assert torch.equal(out.routing[i].expert_ids_NA[: v.shape[0]], v.long())


def _records(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "event" not in r]


def test_a_tiny_run_raises_its_reward(micro_ckpt, tmp_path):
    cfg = _cfg(
        micro_ckpt,
        rl=RLLoopConfig(steps=16, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100),
        optim=replace(RLRunConfig().optim, lr=3e-3),
        objective=ObjectiveConfig(loss="grpo", minibatches=1, ahrl=False, wpsm=False),
        rollout=RolloutConfig(queries_per_step=8, group_size=8, chunk=4, pool_size=0),
    )
    RLTrainer(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True).run()
    rewards = [r["reward"] for r in _records(tmp_path / "rl")]
    assert len(rewards) == 16
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards


def test_resume_equals_an_uninterrupted_run(micro_ckpt, tmp_path):
    cfg = _cfg(micro_ckpt)
    RLTrainer(cfg, tmp_path / "whole", {"toy": ToyVerifier()}, quiet=True).run()
    RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, quiet=True).run(until=2)  # "killed" after step 2
    state = json.loads((checkpoint_dirs(tmp_path / "cut")[-1] / "train_state.json").read_text())
    assert state["state"]["buffer"]["rollouts"]
    RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, resume=True, quiet=True).run()
    whole, cut = _records(tmp_path / "whole"), _records(tmp_path / "cut")
    drop = ("idle_s", "train_s")
    diffs = [
        (r["step"], k, r.get(k), c.get(k))
        for r, c in zip(whole, cut, strict=True)
        for k in sorted(set(r) | set(c))
        if k not in drop and r.get(k) != c.get(k)
    ]
    assert len(whole) == len(cut) and not diffs, diffs[:6]
    a = load_checkpoint(checkpoint_dirs(tmp_path / "whole")[-1], fast=False).model.state_dict()
    b = load_checkpoint(checkpoint_dirs(tmp_path / "cut")[-1], fast=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_metrics_carry_the_issue_fields(micro_ckpt, tmp_path):
    RLTrainer(_cfg(micro_ckpt), tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True).run()
    lines = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["event"] == "pass_init" and lines[-1]["event"] == "pass_final"
    assert lines[-1]["n_hard"] + lines[-1]["n_easy"] == 8 and lines[-1]["step"] == 4
    rec = lines[-2]
    for key in (
        "reward",
        "entropy",
        "response_len",
        "clip_frac",
        "mismatch_masked_frac",
        "wpsm_masked_frac",
        "hint_frac",
        "idle_s",
        "slot_utilisation",
        "reward_by_modality",
        "entropy_by_modality",
        "by_subnet",
    ):
        assert key in rec, key
    assert rec["reward_by_modality"].keys() == {"text"}


def test_bad_configs_are_one_line_errors(micro_ckpt, tmp_path):
    with pytest.raises(RunError, match="objective.ahrl needs rollout.pool_size > 0"):
        RLTrainer(
            _cfg(micro_ckpt, rollout=RolloutConfig(pool_size=0)), tmp_path / "a", {"toy": ToyVerifier()}
        )
    with pytest.raises(RunError, match="no verifier for rl task"):
        RLTrainer(_cfg(micro_ckpt, tasks={"other": 1.0}), tmp_path / "b", {"toy": ToyVerifier()})
    cfg = _cfg(micro_ckpt, rl=RLLoopConfig(steps=1, init_from=str(micro_ckpt), dtype="fp32"))
    RLTrainer(cfg, tmp_path / "c", {"toy": ToyVerifier()}, quiet=True).run()
    with pytest.raises(RunError, match="already holds a run"):
        RLTrainer(cfg, tmp_path / "c", {"toy": ToyVerifier()})
    other = replace(cfg, optim=replace(cfg.optim, lr=1.0))
    with pytest.raises(RunError, match="different config"):
        RLTrainer(other, tmp_path / "c", {"toy": ToyVerifier()}, resume=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_rl_on_cuda_without_a_gpu_is_a_one_line_error(micro_ckpt, tmp_path):
    cfg = _cfg(micro_ckpt, rl=RLLoopConfig(steps=1, init_from=str(micro_ckpt), dtype="fp32", device="cuda"))
    with pytest.raises(RunError, match="rl.device: device='cuda', but no CUDA GPU is visible"):
        RLTrainer(cfg, tmp_path / "gpu", {"toy": ToyVerifier()}, quiet=True).run()
    assert not (tmp_path / "gpu" / "config.yaml").exists()


def test_a_media_task_on_a_text_only_checkpoint_is_a_one_line_error(micro_ckpt, tmp_path):
    class ImageVerifier(ToyVerifier):
        modality = "image"

    with pytest.raises(RunError, match="rl task toy asks about images; .* has no vision tokenizer"):
        RLTrainer(_cfg(micro_ckpt), tmp_path / "img", {"toy": ImageVerifier()}, quiet=True).run()


def test_rl_config_takes_the_checkpoints_model_and_overrides(micro_ckpt, tmp_path):
    cfg = rl_config(str(micro_ckpt), None, ["rl.steps=3", "rollout.scheduler=april"])
    assert to_dict(cfg.model) == to_dict(load_checkpoint(micro_ckpt, fast=False).cfg)
    assert cfg.rl.steps == 3 and cfg.rollout.scheduler == "april" and cfg.rl.init_from == str(micro_ckpt)
    assert from_dict(RLRunConfig, to_dict(cfg)) == cfg
