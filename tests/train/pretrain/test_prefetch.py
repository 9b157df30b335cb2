"""Micro-batches built ahead in data-loader workers equal the trainer's own (tokenizer disaggregation)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ernie5.config import load
from ernie5.presets import resolve_config_path
from ernie5.tokenizers.audio_codec import AudioCodec
from ernie5.tokenizers.audio_config import AudioCodecConfig
from ernie5.tokenizers.text import TextTokenizer
from ernie5.tokenizers.vision import VisionTokenizer
from ernie5.tokenizers.vision_config import VisionTokenizerConfig
from train.pretrain.config import RunConfig
from train.pretrain.data import MixtureStream, open_sources, tokenizer_corpus
from train.pretrain.prefetch import PrefetchStream, StreamSpec, TrainKeys

KEYS = TrainKeys(start_step=2, steps=4, grad_accum=2, world=2, rank=1)
"""Micro-batches 0 and 1 of process 1 of 2, steps 2 and 3: (2, 1), (2, 3), (3, 1), (3, 3)."""
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def _cfg(*extra: str) -> RunConfig:
    return load(
        RunConfig,
        resolve_config_path("micro"),
        [
            "model.max_seq_len=512",
            "data.seq_len=512",
            "data.batch_size=1",
            "model.vision.enabled=true",
            "model.vision.cnn_channels=16",
            "model.vision.latent_bits=6",
            "model.audio.enabled=true",
            "model.audio.n_levels=2",
            "model.audio.codebook_size=16",
            "data.sources={procedural: 0.3, shapes: 0.3, moving_shapes: 0.2, dtmf: 0.2}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def parts():
    """The arguments of a tiny multimodal stream: config, text tokenizer, vision tokenizer, codec."""
    cfg = _cfg()
    torch.manual_seed(0)
    vt = VisionTokenizerConfig(base_channels=8, channel_mult=(1, 2), norm_groups=4, latent_bits=6, mode="3d")
    vtok = VisionTokenizer(vt).eval().requires_grad_(False)
    codec_cfg = AudioCodecConfig(channels=4, max_channels=16, latent_dim=8, n_levels=2, codebook_size=16)
    codec = AudioCodec(codec_cfg).eval().requires_grad_(False)
    sources = open_sources(cfg.data, None, cfg.model.vision.image_size)
    tok = TextTokenizer.train(tokenizer_corpus(sources, 5000, 0), cfg.model.vocab_size)
    return cfg, tok, vtok, codec


@pytest.fixture(scope="module")
def reference(parts):
    """``MixtureStream.batch`` of every key in ``KEYS``, built in this process."""
    stream = _stream(parts)
    out = {k: stream.batch(*k) for k in KEYS}
    assert any(b.inputs.vision is not None for b in out.values())
    assert any(b.inputs.audio is not None for b in out.values())
    return out


def _stream(parts, cfg: RunConfig | None = None) -> MixtureStream:
    base, tok, vtok, codec = parts
    cfg = cfg or base
    sources = open_sources(cfg.data, None, cfg.model.vision.image_size)
    return MixtureStream(cfg.data, sources, tok, 0, vtok, cfg.model.vision, codec)


def _assert_same(a, b, where: str = "batch") -> None:
    """Every tensor equal (dtype, shape, values) and every other field equal, recursively."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif dataclasses.is_dataclass(a):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            _assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        return (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (from /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def test_train_keys_follow_the_loop_order():
    keys = TrainKeys(start_step=3, steps=5, grad_accum=2, world=3, rank=1)
    want = [(s, m * 3 + 1) for s in range(3, 5) for m in range(2)]
    assert list(keys) == want and len(keys) == 4 and keys[-1] == want[-1]
    with pytest.raises(IndexError):
        keys[4]
    assert len(TrainKeys(start_step=5, steps=5)) == 0


@pytest.mark.parametrize("workers", [0, 1, 2])
def test_prefetched_batches_equal_the_stream(parts, reference, workers):
    with PrefetchStream(lambda: _stream(parts), KEYS, workers=workers, depth=2) as ps:
        for k in KEYS:
            _assert_same(ps.batch(*k), reference[k], f"batch{k}")
            assert ps.wait_s >= 0
        assert ps.n_sync == 0
        assert ps.pop_wait_s() > 0 and ps.pop_wait_s() == 0


def test_from_config_reads_workers_and_prefetch(parts, reference):
    cfg = parts[0]
    with PrefetchStream.from_config(lambda: _stream(parts), cfg.data, KEYS) as ps:
        assert (ps.workers, ps.depth) == (getattr(cfg.data, "workers", 0), getattr(cfg.data, "prefetch", 2))
    data = SimpleNamespace(workers=1, prefetch=3)
    with PrefetchStream.from_config(lambda: _stream(parts), data, KEYS) as ps:
        assert (ps.workers, ps.depth) == (1, 3)
        _assert_same(ps.batch(*KEYS[0]), reference[KEYS[0]])
        assert ps.n_sync == 0


def test_a_key_out_of_order_is_built_synchronously(parts, reference):
    with PrefetchStream(lambda: _stream(parts), KEYS, workers=2) as ps:
        with pytest.warns(UserWarning, match=r"key \(3, 1\) asked while \(2, 1\) was next"):
            _assert_same(ps.batch(3, 1), reference[(3, 1)])
        for k in KEYS:  # the prefetch order is where it was
            _assert_same(ps.batch(*k), reference[k])
        assert ps.n_sync == 1
        _assert_same(ps.batch(2, 1), reference[(2, 1)])  # past the last key: synchronous too
        assert ps.n_sync == 2


def test_a_worker_error_reaches_the_trainer_with_its_message(parts):
    cfg = _cfg("data.seq_len=32", "model.max_seq_len=32", "data.sources={shapes: 1.0}")
    with (
        PrefetchStream(lambda: _stream(parts, cfg), [(0, 0)], workers=1) as ps,
        pytest.raises(ValueError, match="positions > data.seq_len=32"),
    ):
        ps.batch(0, 0)


@needs_proc
def test_close_leaves_no_child_processes(parts, reference):
    before = set(_children(os.getpid()))
    ps = PrefetchStream(lambda: _stream(parts), KEYS, workers=2, depth=1)
    _assert_same(ps.batch(*KEYS[0]), reference[KEYS[0]])
    assert len(set(_children(os.getpid())) - before) == 2
    ps.close()
    ps.close()
    assert set(_children(os.getpid())) - before == set()
    _assert_same(ps.batch(*KEYS[1]), reference[KEYS[1]])  # closed: synchronous


@pytest.mark.slow
def test_spawned_workers_build_the_same_batches_from_a_stream_spec(parts, reference):
    cfg, tok, vtok, codec = parts
    spec = StreamSpec(cfg.data, None, tok, 0, vtok, cfg.model.vision, codec, cfg.model.vision.image_size)
    with PrefetchStream(spec, KEYS, workers=2, mp_context="spawn") as ps:
        for k in KEYS:
            _assert_same(ps.batch(*k), reference[k])
        assert ps.n_sync == 0


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from ernie5.config import load
    from ernie5.presets import resolve_config_path
    from ernie5.tokenizers.text import TextTokenizer
    from train.pretrain.config import RunConfig
    from train.pretrain.data import MixtureStream, open_sources, tokenizer_corpus
    from train.pretrain.prefetch import PrefetchStream, TrainKeys

    cfg = load(RunConfig, resolve_config_path("micro"), ["data.sources={procedural: 1.0}"])
    sources = open_sources(cfg.data, None)
    tok = TextTokenizer.train(tokenizer_corpus(sources, 5000, 0), cfg.model.vocab_size)
    ps = PrefetchStream(lambda: MixtureStream(cfg.data, sources, tok, 0), TrainKeys(0, 10_000), workers=2)
    ps.batch(0, 0)
    print("ready", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
@needs_proc
def test_workers_exit_when_the_trainer_is_killed(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(_ORPHAN_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        workers = _children(proc.pid)
        assert len(workers) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.2)
        alive = [w for w in workers if _alive(w)]
        assert alive == [], f"workers {alive} outlived the killed trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
