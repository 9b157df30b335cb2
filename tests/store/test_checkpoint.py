"""Tests of checkpoint save/load, verification, run-folder resolution and exact optimizer resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ernie5.fast import is_fast
from ernie5.model import Ernie5Model, ModelConfig, MoEConfig
from ernie5.store import checkpoint as ckpt_mod
from ernie5.store.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    checkpoint_hash,
    file_sha256,
    load_checkpoint,
    load_train_state,
    resolve_checkpoint,
    save_checkpoint,
)
from ernie5.tokenizers.text import TextTokenizer

MOE = MoEConfig(n_experts=4, d_expert=16, top_k=2)
CFG = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, moe=MOE)
TIED = ModelConfig(
    vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, moe=MOE, tie_embeddings=True
)


def _model(cfg: ModelConfig = CFG, seed: int = 0) -> Ernie5Model:
    torch.manual_seed(seed)
    model = Ernie5Model(cfg)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            layer.ffn.router_bias.copy_(torch.linspace(-0.1, 0.1, MOE.n_experts) * (i + 1))
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(1))


def _logits(model: Ernie5Model) -> torch.Tensor:
    """The text logits of ``_ids()``; an eager model (``fast=False``) computes the reference maths."""
    with torch.no_grad():
        return model(_ids()).logits_BTV


@pytest.fixture
def no_torch_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load must not be called")

    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer.train(["hello world, hello checkpoints"] * 10, vocab_size=280)


@pytest.mark.parametrize("cfg", [CFG, TIED], ids=["untied", "tied"])
def test_round_trip(tmp_path, cfg: ModelConfig, no_torch_load) -> None:
    model = _model(cfg)
    save_checkpoint(tmp_path / "ck", model, meta={"step": 7, "git": "abc"})
    ck = load_checkpoint(tmp_path / "ck", fast=False)
    assert not is_fast(ck.model)
    assert ck.cfg == cfg and ck.model.cfg == cfg and ck.tokenizer is None
    assert ck.meta["step"] == 7 and ck.meta["format"] == 1
    want, got = model.state_dict(), ck.model.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert torch.equal(want[k], got[k]) and want[k].dtype == got[k].dtype, k
    assert torch.equal(ck.model.inv_freq, model.inv_freq)
    assert (ck.model.head.weight is ck.model.tok_emb.weight) == cfg.tie_embeddings
    assert len(list(ck.model.parameters())) == len(list(model.parameters()))
    assert all(p.requires_grad for p in ck.model.parameters())
    assert torch.equal(_logits(ck.model), _logits(model))
    # The default load applies the fast paths: same tensors, same function (to kernel rounding).
    fast = load_checkpoint(tmp_path / "ck")
    assert is_fast(fast.model)
    assert fast.model.state_dict().keys() == want.keys()
    for k, v in fast.model.state_dict().items():
        assert torch.equal(v, want[k]), k
    assert (fast.model.head.weight is fast.model.tok_emb.weight) == cfg.tie_embeddings
    torch.testing.assert_close(_logits(fast.model), _logits(model), rtol=1e-5, atol=1e-5)


def test_tied_weight_stored_once(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", _model(TIED))
    from safetensors import safe_open

    with safe_open(tmp_path / "ck" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())  # noqa: SIM118
    assert "tok_emb.weight" in keys and "head.weight" not in keys


def test_meta_manifest_and_tokenizer(tmp_path, tokenizer: TextTokenizer) -> None:
    path = save_checkpoint(
        tmp_path / "ck",
        _model(),
        tokenizer=tokenizer,
        meta={"format": 99, "x": 1},
        extra_files={"a.txt": b"hi"},
    )
    meta = json.loads((path / "meta.json").read_text())
    assert meta["format"] == 1 and meta["x"] == 1
    assert sorted(meta["files"]) == ["a.txt", "config.yaml", "model.safetensors", "tokenizer.json"]
    for name, entry in meta["files"].items():
        assert entry == {"sha256": file_sha256(path / name), "bytes": (path / name).stat().st_size}
    ck = load_checkpoint(path)
    assert ck.tokenizer == tokenizer
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temp dir left behind


def test_dtype_bf16(tmp_path) -> None:
    model = _model()
    save_checkpoint(tmp_path / "ck", model)
    ck = load_checkpoint(tmp_path / "ck", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ck.model.parameters())
    assert ck.model.layers[0].ffn.router_bias.dtype == torch.float32  # buffers keep their dtype
    ref = model.to(torch.bfloat16)
    for (k, p), q in zip(ref.named_parameters(), ck.model.parameters()):
        assert torch.equal(p, q), k
    assert _logits(ck.model).dtype == torch.bfloat16


def test_bf16_model_round_trip(tmp_path) -> None:
    model = _model().to(torch.bfloat16)
    save_checkpoint(tmp_path / "ck", model)
    ck = load_checkpoint(tmp_path / "ck")
    assert all(v.dtype == torch.bfloat16 for v in ck.model.state_dict().values() if v.is_floating_point())
    # `.to(bf16)` also rounded the non-persistent RoPE table, which loading recomputes in fp32.
    assert ck.model.inv_freq.dtype == torch.float32
    model.inv_freq = ck.model.inv_freq.clone()
    eager = load_checkpoint(tmp_path / "ck", fast=False)
    assert torch.equal(_logits(eager.model), _logits(model))


def test_overwrite_existing(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", _model(seed=0), meta={"v": 1})
    save_checkpoint(tmp_path / "ck", _model(seed=1), meta={"v": 2})
    ck = load_checkpoint(tmp_path / "ck", fast=False)
    assert ck.meta["v"] == 2 and torch.equal(_logits(ck.model), _logits(_model(seed=1)))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-50] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, name, verify, match",
    [
        (_truncate, "model.safetensors", True, "model.safetensors: .* bytes, but meta.json says"),
        (_truncate, "model.safetensors", False, "model.safetensors: unreadable safetensors file"),
        (_flip, "model.safetensors", True, "model.safetensors: sha256 differs"),
        (_flip, "config.yaml", True, "config.yaml: sha256 differs"),
        (Path.unlink, "model.safetensors", True, "ck: missing model.safetensors"),
        (Path.unlink, "config.yaml", False, "ck: missing config.yaml"),
        (Path.unlink, "meta.json", True, "ck: missing meta.json"),
        (lambda p: p.write_text("{oops"), "meta.json", True, "meta.json: malformed JSON"),
        (lambda p: p.write_text('{"format": 2}'), "meta.json", True, "meta.json: unsupported format 2"),
        (lambda p: p.write_text("d_model: [\n"), "config.yaml", False, "config.yaml: malformed YAML"),
        (lambda p: p.write_text("d_modl: 32\n"), "config.yaml", False, "config.yaml: unknown key 'd_modl'"),
        (lambda p: p.write_text("n_heads: 5\n"), "config.yaml", False, "config.yaml: n_kv_heads=2 must"),
    ],
)
def test_damaged_checkpoint(tmp_path, damage, name: str, verify: bool, match: str, no_torch_load) -> None:
    path = save_checkpoint(tmp_path / "ck", _model())
    damage(path / name)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(path, verify=verify)
    assert "\n" not in str(err.value)


def test_missing_dir(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="nope: checkpoint directory not found"):
        load_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize(
    "edit, match",
    [
        ("d_model: 48", r"tok_emb.weight has shape \[300, 32\], config.yaml's model \[300, 48\]"),
        ("n_layers: 3", r"missing tensor layers.2.attn_norm.weight \(shape \[32\]"),
        ("n_layers: 1", r"unexpected tensor layers.1.attn.k_norm.weight \(shape \[8\]\)"),
    ],
)
def test_config_weights_mismatch(tmp_path, edit: str, match: str) -> None:
    path = save_checkpoint(tmp_path / "ck", _model())
    key = edit.split(":")[0]
    text = "\n".join(
        edit if line.startswith(f"{key}:") else line
        for line in (path / "config.yaml").read_text().splitlines()
    )
    (path / "config.yaml").write_text(text + "\n")
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, verify=False)


def test_tokenizer_larger_than_vocab(tmp_path, tokenizer: TextTokenizer) -> None:
    cfg = ModelConfig(vocab_size=100, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, moe=MOE)
    with pytest.raises(ValueError, match="tokenizer has 280 tokens > model vocab_size=100"):
        save_checkpoint(tmp_path / "ck", Ernie5Model(cfg), tokenizer=tokenizer)


@pytest.mark.parametrize("name", ["meta.json", "model.safetensors", "../x", "sub/x", ".hidden", ""])
def test_bad_extra_file_names(tmp_path, name: str) -> None:
    with pytest.raises(ValueError, match="must be a plain file name"):
        save_checkpoint(tmp_path / "ck", _model(), extra_files={name: b""})
    assert not (tmp_path / "ck").exists()


def test_meta_not_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="meta is not JSON-serialisable"):
        save_checkpoint(tmp_path / "ck", _model(), meta={"x": object()})


def test_failed_save_leaves_nothing(tmp_path, monkeypatch) -> None:
    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_mod, "publish_folder", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "ck", _model())
    assert list(tmp_path.iterdir()) == []


def test_resolve_run_folder(tmp_path) -> None:
    run = tmp_path / "run"
    save_checkpoint(checkpoint_dir(run, 100), _model(seed=0))
    save_checkpoint(checkpoint_dir(run, 2000), _model(seed=1))
    # A crash mid-save: a hidden temp dir of a newer step, and a step dir without meta.json.
    newer_tmp = run / "checkpoints" / ".step_00003000.tmp-123"
    newer_tmp.mkdir()
    (newer_tmp / "meta.json").write_text("{}")
    (run / "checkpoints" / "step_00004000").mkdir()
    (run / "checkpoints" / "step_00004000" / "model.safetensors").write_bytes(b"partial")
    assert resolve_checkpoint(run) == run / "checkpoints" / "step_00002000"
    assert resolve_checkpoint(run / "checkpoints" / "step_00000100") == run / "checkpoints" / "step_00000100"
    assert checkpoint_hash(run) == checkpoint_hash(run / "checkpoints" / "step_00002000")
    # load_checkpoint resolves its own argument: the run folder loads its newest complete step.
    got = load_checkpoint(run, fast=False)
    assert got.path == run / "checkpoints" / "step_00002000"
    want = _model(seed=1).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in got.model.state_dict().items())


@pytest.mark.parametrize(
    "setup, match",
    [
        (lambda p: None, "not a checkpoint or a run folder with checkpoints"),
        (lambda p: (p / "checkpoints" / "step_00000001").mkdir(parents=True), "no complete checkpoint"),
    ],
)
def test_resolve_errors(tmp_path, setup, match: str) -> None:
    setup(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        resolve_checkpoint(tmp_path)


def test_checkpoint_hash(tmp_path, tokenizer: TextTokenizer) -> None:
    a = save_checkpoint(tmp_path / "a", _model(seed=0), meta={"step": 1})
    b = save_checkpoint(tmp_path / "b", _model(seed=0), meta={"step": 2})  # same model, other meta
    c = save_checkpoint(tmp_path / "c", _model(seed=1))
    d = save_checkpoint(tmp_path / "d", _model(seed=0), tokenizer=tokenizer)
    h = checkpoint_hash(a)
    assert len(h) == 12 and h == checkpoint_hash(b)
    assert len({h, checkpoint_hash(c), checkpoint_hash(d)}) == 3


def test_unknown_transient_buffer_falls_back_to_init(tmp_path, monkeypatch) -> None:
    class WithTable(Ernie5Model):
        def __init__(self, cfg: ModelConfig) -> None:
            super().__init__(cfg)
            self.register_buffer("table", torch.arange(4.0), persistent=False)

    save_checkpoint(tmp_path / "ck", _model())
    monkeypatch.setattr(ckpt_mod, "Ernie5Model", WithTable)
    ck = load_checkpoint(tmp_path / "ck", fast=False)
    assert torch.equal(ck.model.table, torch.arange(4.0))
    assert torch.equal(_logits(ck.model), _logits(_model()))


# ---------------------------------------------------------------------- exact resume
def _train(model: Ernie5Model, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 300, (2, 9), generator=g)
        out = model(ids, targets=ids.roll(-1, 1))
        opt.zero_grad()
        (out.losses.text + sum(out.losses.mtp)).backward()
        opt.step()


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "adamw-fused"])
def test_optimizer_exact_resume(tmp_path, fused: bool, no_torch_load) -> None:
    model = _model(TIED)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)
    _train(model, opt, 3, seed=0)
    rng = {"torch": torch.get_rng_state()}
    save_checkpoint(tmp_path / "ck", model, train_state=(opt, rng, {"step": 3, "tokens": 54}))
    assert {"optimizer.safetensors", "train_state.json", "train_tensors.safetensors"} <= set(
        json.loads((tmp_path / "ck" / "meta.json").read_text())["files"]
    )

    ck = load_checkpoint(tmp_path / "ck", fast=False)  # eager, as the model trained above
    r_decay = [p for n, p in ck.model.named_parameters() if p.dim() >= 2]
    r_rest = [p for n, p in ck.model.named_parameters() if p.dim() < 2]
    r_groups = [{"params": r_decay, "weight_decay": 0.0}, {"params": r_rest, "weight_decay": 0.5}]
    r_opt = torch.optim.AdamW(r_groups, lr=1.0, fused=fused)
    tensors, state = load_train_state(tmp_path / "ck", optimizer=r_opt)
    assert state == {"step": 3, "tokens": 54}
    assert torch.equal(tensors["torch"], rng["torch"]) and tensors["torch"].dtype == torch.uint8
    assert r_opt.param_groups[0]["betas"] == (0.9, 0.95) and r_opt.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(model.parameters(), ck.model.parameters()):
        for k, v in opt.state[p].items():
            assert torch.equal(v, r_opt.state[q][k]) and v.dtype == r_opt.state[q][k].dtype, k

    _train(model, opt, 2, seed=1)
    _train(ck.model, r_opt, 2, seed=1)
    for (k, p), q in zip(model.named_parameters(), ck.model.parameters()):
        assert torch.equal(p, q), k


def test_train_state_mismatch(tmp_path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    _train(model, opt, 1, seed=0)
    save_checkpoint(tmp_path / "ck", model, train_state=(opt, {}, {}))
    other = torch.optim.AdamW(list(model.parameters())[:3])
    with pytest.raises(CheckpointError, match="train_state.json: optimizer state does not fit"):
        load_train_state(tmp_path / "ck", optimizer=other)


def test_train_state_missing(tmp_path) -> None:
    save_checkpoint(tmp_path / "ck", _model())
    with pytest.raises(CheckpointError, match="missing train_state.json"):
        load_train_state(tmp_path / "ck", optimizer=torch.optim.AdamW(_model().parameters()))


def test_train_state_not_json(tmp_path) -> None:
    model = _model()
    with pytest.raises(ValueError, match="train state is not JSON-serialisable"):
        save_checkpoint(
            tmp_path / "ck", model, train_state=(torch.optim.SGD(model.parameters()), {}, {"x": {1, 2}})
        )
    assert not (tmp_path / "ck").exists()


# ---------------------------------------------------------------------- checkpoints of the old code
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LEGACY = FIXTURES / "legacy_b6863a2"
"""A tiny multimodal checkpoint saved by the code before the redesign (commit b6863a2): its
config.yaml holds the retired key ``moe.dispatch: auto``."""
LEGACY_EXPECTED = FIXTURES / "legacy_b6863a2_expected.safetensors"
"""What the old code's eager loop path computed on it: ``ids``, ``logits``, ``loss``, ``mtp_loss``
of ``model(ids, targets_BT=ids.roll(-1, 1), dispatch="loop")`` in fp32."""


@pytest.mark.parametrize("fast, rtol, atol", [(False, 1e-6, 1e-6), (True, 1e-5, 1e-6)], ids=["eager", "fast"])
def test_legacy_checkpoint_computes_the_same_function(
    fast: bool, rtol: float, atol: float, no_torch_load
) -> None:
    from safetensors.torch import load_file

    assert "  dispatch: auto\n" in (LEGACY / "config.yaml").read_text()  # the fixture is what it claims
    want = load_file(LEGACY_EXPECTED)
    ck = load_checkpoint(LEGACY, fast=fast)  # verify=True: the old manifest still matches
    assert is_fast(ck.model) == fast
    assert ck.meta["step"] == 7 and ck.meta["written_by"] == "b6863a2"
    assert ck.cfg.vision.enabled and ck.cfg.audio.enabled and ck.cfg.mtp.n_depth == 1
    assert (ck.cfg.moe.n_experts, ck.cfg.moe.top_k, ck.cfg.moe.n_shared_experts) == (4, 2, 1)
    assert not hasattr(ck.cfg.moe, "dispatch")
    assert all(p.dtype == torch.float32 for p in ck.model.parameters())

    ids = want["ids"]
    assert ids.shape == (2, 12) and ids.dtype == torch.int64
    with torch.no_grad():
        out = ck.model(ids, targets=ids.roll(-1, 1))
    assert out.logits_BTV.dtype == torch.float32 and out.logits_BTV.shape == want["logits"].shape
    torch.testing.assert_close(out.logits_BTV, want["logits"], rtol=rtol, atol=atol)
    torch.testing.assert_close(out.losses.text.reshape(1), want["loss"], rtol=rtol, atol=atol)
    assert len(out.losses.mtp) == 1
    torch.testing.assert_close(out.losses.mtp[0].reshape(1), want["mtp_loss"], rtol=rtol, atol=atol)


def test_legacy_checkpoint_resaves_without_the_retired_key(tmp_path) -> None:
    ck = load_checkpoint(LEGACY, fast=False)
    save_checkpoint(tmp_path / "ck", ck.model, meta=ck.meta)
    text = (tmp_path / "ck" / "config.yaml").read_text()
    assert "dispatch" not in text and "moe:" in text
    again = load_checkpoint(tmp_path / "ck", fast=False)
    assert again.cfg == ck.cfg and again.meta["written_by"] == "b6863a2"
    assert torch.equal(_legacy_logits(again.model), _legacy_logits(ck.model))


def _legacy_logits(model: Ernie5Model) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits_BTV


def _copy_with_dispatch(dst: Path, value: str, update_manifest: bool) -> Path:
    import shutil

    shutil.copytree(LEGACY, dst)
    cfg = dst / "config.yaml"
    text = cfg.read_text()
    assert text.count("  dispatch: auto\n") == 1
    cfg.write_text(text.replace("  dispatch: auto\n", f"  dispatch: {value}\n"))
    if update_manifest:
        meta = json.loads((dst / "meta.json").read_text())
        meta["files"]["config.yaml"] = {"sha256": file_sha256(cfg), "bytes": cfg.stat().st_size}
        (dst / "meta.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize("update_manifest", [True, False], ids=["manifest", "no-verify"])
@pytest.mark.parametrize("value", ["sorted", "loop", "grouped"])
def test_retired_key_other_value_is_an_error(tmp_path, value: str, update_manifest: bool) -> None:
    path = _copy_with_dispatch(tmp_path / "ck", value, update_manifest)
    with pytest.raises(
        CheckpointError, match=rf"config\.yaml: moe\.dispatch='{value}': the key is retired"
    ) as err:
        load_checkpoint(path, verify=update_manifest)
    assert "\n" not in str(err.value) and str(path) in str(err.value) and "'auto'" in str(err.value)


def test_retired_key_edit_without_manifest_update_fails_verification(tmp_path) -> None:
    path = _copy_with_dispatch(tmp_path / "ck", "sorted", update_manifest=False)
    with pytest.raises(CheckpointError, match="config.yaml: .* bytes, but meta.json says"):
        load_checkpoint(path)
