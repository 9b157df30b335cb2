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
from evals.hints import Skeleton
from train.common.run_folder import RunError
from train.pretrain.config import ElasticConfig, RunConfig
from train.pretrain.loop import pretrain
from train.rl.buffer import Rollout
from train.rl.config import ObjectiveConfig, RLLoopConfig, RLRunConfig, RolloutConfig
from train.rl.objectives import group_advantages
from train.rl.rollout_text import Prompt, RolloutEngine, rollout_document
from train.rl.trainer import RLTrainer, rl_config


@dataclass(frozen=True)
class ToyQuery:
    context: str
    max_new_tokens: int = 4
    stop: tuple[str, ...] = ("\n",)
    skeleton: Skeleton = Skeleton(("the answer has an e", "eee"))


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
        rl=RLLoopConfig(steps=20, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100),
        optim=replace(RLRunConfig().optim, lr=3e-3),
        objective=ObjectiveConfig(loss="grpo", minibatches=1, ahrl=False, wpsm=False),
        rollout=RolloutConfig(queries_per_step=8, group_size=8, chunk=4, pool_size=0),
    )
    RLTrainer(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True).run()
    rewards = [r["reward"] for r in _records(tmp_path / "rl")]
    assert len(rewards) == 20
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards


def test_resume_equals_an_uninterrupted_run(micro_ckpt, tmp_path):
    cfg = _cfg(micro_ckpt)
    RLTrainer(cfg, tmp_path / "whole", {"toy": ToyVerifier()}, quiet=True).run()
    RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, quiet=True).run(until=2)  # "killed" after step 2
    state = json.loads((checkpoint_dirs(tmp_path / "cut")[-1] / "train_state.json").read_text())
    assert state["state"]["buffer"]["rollouts"]
    RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, resume=True, quiet=True).run()
    whole, cut = _records(tmp_path / "whole"), _records(tmp_path / "cut")
    drop = ("idle_s", "train_s", "tokens_per_s")  # wall-clock figures
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


class GradedVerifier(ToyVerifier):
    """A graded reward, as tts, t2i and asr give: 1 with an ``e``, else 0.5 (never 0)."""

    def reward(self, query: ToyQuery, text: str) -> float:
        return 1.0 if "e" in text else 0.5


LOSSES = ("misc", "grpo_icepop", "gspo_icepop", "gspo", "grpo")


@pytest.mark.parametrize("loss", LOSSES)
def test_every_objective_applies_the_sequence_weight(micro_ckpt, tmp_path, loss):
    """WPSM's weight reaches the loss of every arm (GSPO and GRPO dropped it): a zero weight gives a zero
    loss and no gradient, half the weight half the loss."""
    cfg = _cfg(micro_ckpt, objective=ObjectiveConfig(loss=loss))
    trainer = RLTrainer(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) - 0.1
    new = (old + 1e-5 * torch.randn(4, 6, generator=g)).requires_grad_()  # inside every clip
    infer = old + 0.01 * torch.randn(4, 6, generator=g)
    adv, mask = torch.tensor([1.0, -0.5, 0.7, -1.2]), torch.ones(4, 6, dtype=torch.bool)
    zero, _ = trainer._loss(new, old, infer, adv, mask, torch.zeros(4))
    assert zero.item() == 0.0
    (grad,) = torch.autograd.grad(zero, new, allow_unused=True, materialize_grads=True)
    assert torch.all(grad == 0)
    full, _ = trainer._loss(new, old, infer, adv, mask, torch.ones(4))
    half, _ = trainer._loss(new, old, infer, adv, mask, torch.full((4,), 0.5))
    assert full.item() != 0 and half.item() == pytest.approx(full.item() / 2, rel=1e-6)


def test_wpsm_masks_only_responses_better_than_their_group(micro_ckpt, tmp_path, monkeypatch):
    """With graded rewards every response has reward > 0; only those with a positive advantage are
    positive samples, so WPSM never masks a below-mean response (it masked any reward > 0 before)."""
    import train.rl.trainer as trainer_module

    masks, rewards = [], []
    real_mask = trainer_module.wpsm_mask
    monkeypatch.setattr(
        trainer_module, "wpsm_mask", lambda *a, **k: masks.append(real_mask(*a, **k)) or masks[-1]
    )
    cfg = _cfg(
        micro_ckpt,
        objective=ObjectiveConfig(loss="grpo", minibatches=1, wpsm_threshold=0.0, wpsm_quantile=0.99),
    )
    trainer = RLTrainer(cfg, tmp_path / "rl", {"toy": GradedVerifier()}, quiet=True)
    real_rewards = trainer._rewards
    monkeypatch.setattr(trainer, "_rewards", lambda rows: rewards.append(real_rewards(rows)) or rewards[-1])
    trainer.run()
    group = cfg.rollout.group_size
    step_rewards = [r for r in rewards if len(r) == cfg.rollout.queries_per_step * group]
    assert len(step_rewards) == len(masks) == cfg.rl.steps
    n_masked = 0
    for reward, masked in zip(step_rewards, masks, strict=True):
        adv = group_advantages(torch.tensor(reward).view(-1, group)).reshape(-1)
        assert torch.all(adv[masked] > 0), (reward, masked)
        n_masked += int(masked.sum())
    assert n_masked > 0  # the test exercised the mask


class HalfBlindVerifier(ToyVerifier):
    """Even queries: reward 0 whatever the response (a group with no signal); odd: the toy reward."""

    def reward(self, query: ToyQuery, text: str) -> float:
        return 0.0 if int(query.context.split()[2]) % 2 == 0 else float("e" in text)


def test_dynamic_sampling_refills_the_batch_with_groups_that_carry_signal(micro_ckpt, tmp_path, monkeypatch):
    """DAPO dynamic sampling: groups whose rewards are all equal leave the batch and more groups are
    sampled to refill it; before, they stayed in the batch (zero-weighted) and nothing was resampled."""
    cfg = _cfg(
        micro_ckpt,
        rl=RLLoopConfig(steps=3, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100),
        objective=ObjectiveConfig(dynamic_sampling=True, dynamic_max_batches=6, wpsm=False),
        rollout=RolloutConfig(queries_per_step=3, group_size=6, chunk=2, pool_size=0),
    )
    trainer = RLTrainer(cfg, tmp_path / "rl", {"toy": HalfBlindVerifier()}, quiet=True)
    trained = []
    real_learn = trainer._learn
    monkeypatch.setattr(
        trainer,
        "_learn",
        lambda step, groups, rewards: trained.append(rewards) or real_learn(step, groups, rewards),
    )
    trainer.run()
    recs = _records(tmp_path / "rl")
    assert len(trained) == 3
    filled = 0
    for rewards, rec in zip(trained, recs, strict=True):
        signal = rewards.amax(-1) != rewards.amin(-1)
        if rec["dynamic_dropped_frac"] < 1.0:  # groups with signal were found: only they train
            assert torch.all(signal), rewards
            filled += rewards.shape[0] == 3
        else:  # none in any of the batches: the last batch as it is (advantages all 0)
            assert rec["dynamic_batches"] == 6 and not torch.any(signal)
        assert rec["dynamic_batches"] >= 2 and rec["dynamic_dropped_frac"] >= 0.5 - 1e-9
        assert rec["rows_by_task"]["toy"] == rewards.numel()
    assert filled >= 1


@pytest.mark.parametrize("loss", ["grpo_icepop", "gspo_icepop"])
def test_the_icepop_arms_and_a_kl_to_the_start_train(micro_ckpt, tmp_path, loss):
    cfg = _cfg(
        micro_ckpt,
        rl=RLLoopConfig(steps=2, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100),
        objective=ObjectiveConfig(loss=loss, kl_coef=0.1, kl_estimator="k3", grpo_clip_high=0.28),
    )
    trainer = RLTrainer(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True)
    trainer.run()
    recs = _records(tmp_path / "rl")
    assert [r["step"] for r in recs] == [1, 2]
    assert all(r["kl"] >= 0 and r["kl"] == r["kl"] for r in recs) and recs[-1]["kl"] > 0
    start = load_checkpoint(micro_ckpt, fast=False).model.state_dict()
    ref = trainer.reference.state_dict()
    assert all(torch.equal(ref[k], start[k].to(ref[k].dtype)) for k in start)  # the frozen start
    assert not any(p.requires_grad for p in trainer.reference.parameters())


def test_ahrl_hints_are_skeleton_steps_and_decay_for_never_solved_queries(micro_ckpt, tmp_path):
    """A hard query gets the first steps of its skeleton (prompt, not response), and the hint decays
    even when the query was never solved (pass_init 0 kept the whole hint forever before)."""
    cfg = _cfg(micro_ckpt)
    trainer = RLTrainer(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True)
    trainer._setup()
    trainer.pass_init = {trainer._key(3): 0.0}
    first = trainer._hint_ids(3, step=0)
    assert trainer.tokenizer.decode(first) == ToyQuery("").skeleton.text(1) == " [the answer has an e]"
    assert trainer._hint_ids(3, step=cfg.rl.steps) == []  # decayed: 0.5 exp(-8 ln2 / G) x 2 steps < 0.5
    r = Rollout(3, 0, hint=first, tokens=trainer.tokenizer.encode(" ok"))
    assert trainer.rollouts["text"].answers([r]) == [" ok"]  # the reward reads the response only


def test_rollouts_from_an_inference_replica_differ_from_the_learner(micro_ckpt, tmp_path):
    """``rollout.engine=inference``: a bf16, fused-decoding replica samples while the fp32 learner scores,
    so the train/inference mismatch on fresh tokens is real (it is exactly 0 when the learner's own copy
    samples), small, and logged per output and modality with the routing disagreement; the replica
    follows the master after every optimizer step."""
    recs = {}
    for engine in ("learner", "inference"):
        cfg = _cfg(
            micro_ckpt,
            rl=RLLoopConfig(steps=2, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100),
            rollout=RolloutConfig(queries_per_step=4, group_size=4, chunk=2, pool_size=8, engine=engine),
        )
        trainer = RLTrainer(cfg, tmp_path / engine, {"toy": ToyVerifier()}, quiet=True)
        trainer.run()
        recs[engine] = [r for r in _records(tmp_path / engine) if "event" not in r]
    first = {e: r[0] for e, r in recs.items()}
    assert first["learner"]["staleness"] == 0 == first["inference"]["staleness"]
    assert first["learner"]["logp_mismatch"] < 1e-5
    assert 1e-4 < first["inference"]["logp_mismatch"] < 0.1
    assert first["inference"]["logp_mismatch_by_output"].keys() == {"text"}
    assert first["inference"]["logp_mismatch_by_modality"]["text"] == pytest.approx(
        first["inference"]["logp_mismatch"], rel=1e-5
    )
    for rec in recs["inference"]:
        assert 0 <= rec["routing_disagreement"] <= 1
    assert first["learner"]["routing_disagreement"] == 0  # same engine, same routing
    master = trainer.model.state_dict()
    replica = trainer.inference.state_dict()
    assert all(replica[k].dtype == torch.bfloat16 for k in master if master[k].is_floating_point())
    assert all(torch.equal(replica[k], master[k].to(replica[k].dtype)) for k in master)  # synced


def test_a_nonfinite_rl_loss_is_skipped_and_stop_stops(micro_ckpt, tmp_path, monkeypatch):
    from train.common.nonfinite import DivergedError

    calls = []
    real = RLTrainer._loss

    def poisoned(self, *args):
        loss, stats = real(self, *args)
        calls.append(1)
        return (loss * float("nan"), stats) if len(calls) == 3 else (loss, stats)

    monkeypatch.setattr(RLTrainer, "_loss", poisoned)
    cfg = _cfg(micro_ckpt, objective=ObjectiveConfig(minibatches=2, ahrl=False))
    before = load_checkpoint(micro_ckpt, fast=False).model.state_dict()
    RLTrainer(cfg, tmp_path / "skip", {"toy": ToyVerifier()}, quiet=True).run()
    lines = [json.loads(x) for x in (tmp_path / "skip" / "metrics.jsonl").read_text().splitlines()]
    events = [r for r in lines if r.get("event") == "nonfinite"]
    assert len(events) == 1 and events[0]["what"].startswith("loss (nan) in minibatch")
    after = load_checkpoint(checkpoint_dirs(tmp_path / "skip")[-1], fast=False).model.state_dict()
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the other minibatches learned
    calls.clear()
    stop = replace(cfg, rl=replace(cfg.rl, nonfinite="stop"))
    with pytest.raises(
        DivergedError, match=r"step \d: non-finite loss \(nan\) in minibatch \d \(rl.nonfinite=stop\)"
    ):
        RLTrainer(stop, tmp_path / "stop", {"toy": ToyVerifier()}, quiet=True).run()


def test_a_stop_request_checkpoints_the_iteration_and_resume_is_exact(micro_ckpt, tmp_path, monkeypatch):
    """RL under SIGTERM: the iteration ends, its checkpoint is written, Preempted names it; --resume then
    reproduces the uninterrupted run."""
    from contextlib import contextmanager

    import train.rl.trainer as trainer_module
    from ernie5.runtime.preempt import Preempted, Preemption

    cfg = _cfg(micro_ckpt, rl=RLLoopConfig(steps=4, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=100))
    RLTrainer(cfg, tmp_path / "whole", {"toy": ToyVerifier()}, quiet=True).run()
    real_learn = RLTrainer._learn
    state = Preemption(60)

    def learn(self, step, groups, rewards):
        rec = real_learn(self, step, groups, rewards)
        if step == 1:
            state.signal = "SIGTERM"  # arrives during iteration 2
        return rec

    @contextmanager
    def fake(grace_s):
        yield state

    monkeypatch.setattr(RLTrainer, "_learn", learn)
    monkeypatch.setattr(trainer_module, "preemptible", fake)
    with pytest.raises(Preempted, match="SIGTERM at step 2 of 4: checkpoint .*step_00000002"):
        RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, quiet=True).run()
    monkeypatch.undo()
    RLTrainer(cfg, tmp_path / "cut", {"toy": ToyVerifier()}, resume=True, quiet=True).run()
    a = load_checkpoint(checkpoint_dirs(tmp_path / "whole")[-1], fast=False).model.state_dict()
    b = load_checkpoint(checkpoint_dirs(tmp_path / "cut")[-1], fast=False).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_log_with_tensorboard_gets_reward_entropy_loss_and_mismatch(micro_ckpt, tmp_path):
    from tests.store.test_trackers import needs, tensorboard_scalars

    needs("tensorboard")
    from train.rl.trainer import rl

    cfg = _cfg(micro_ckpt, rl=RLLoopConfig(steps=2, init_from=str(micro_ckpt), dtype="fp32", ckpt_every=2))
    rl(cfg, tmp_path / "rl", {"toy": ToyVerifier()}, quiet=True, log_with=["tensorboard"])
    got = tensorboard_scalars(tmp_path / "rl" / "tensorboard" / "rl")
    records = _records(tmp_path / "rl")
    assert [v for _, v in got["reward"]] == pytest.approx([r["reward"] for r in records])
    assert [s for s, _ in got["reward"]] == [1, 2]
    wanted = {"entropy", "lr", "loss", "tokens_per_s", "logp_mismatch", "logp_mismatch_by_modality/text"}
    assert wanted <= set(got), sorted(got)
    assert all(r["loss"] is not None and r["tokens_per_s"] > 0 for r in records)
    assert any(tag.startswith("pass_init/") for tag in got)
