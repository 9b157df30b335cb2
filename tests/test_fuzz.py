"""Property-based tests (Hypothesis) of every parser a user feeds: sub-model specs, ``--set`` overrides,
suite YAML, checkpoint ``meta.json``, sweep unit files, WAV files and prompts with any Unicode. Every
input ends in a result or the documented one-line error class: never another exception, never a hang.
The inputs the fuzzer found are kept as explicit ``@example`` cases."""

from __future__ import annotations

import contextlib
import io
import struct
import tempfile
import wave
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ernie5.config import ConfigError, apply_overrides, from_dict
from ernie5.data.text import DataCorrupt
from ernie5.subnets.spec import SubnetError, parse_subnet

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FILES = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPEC_CHARS = st.sampled_from(
    list("dwkx.-0123456789eE+_ ,:[]full") + ["full", "random", "d0.5", "k1", "w0.5", "x"]
)


@FAST
@given(st.one_of(st.text(), st.lists(SPEC_CHARS, max_size=12).map("".join)))
@example("d0.5-w0.5-k1")
@example("d1e309")  # an overflowing number
@example("k-0")
@example("w0.5-w0.5")
@example("\x00")
def test_subnet_specs_parse_or_raise_subnet_error(text):
    try:
        spec = parse_subnet(text)
    except SubnetError as e:
        assert "\n" not in str(e).strip() or len(str(e).splitlines()) >= 1
        return
    assert spec is not None


@FAST
@given(st.text(max_size=60))
@example("train.steps=1e999")
@example("train.steps=")
@example("=1")
@example("a.b.c.d.e=1")
@example("train=1")
@example("data.sources={shakespeare: .nan}")
@example("train.steps=!!python/object:os.system")
def test_set_overrides_load_or_raise_config_error(item):
    from train.pretrain.config import RunConfig

    with contextlib.suppress(ConfigError):
        from_dict(RunConfig, apply_overrides({}, [item]))


def _tmp(data: bytes, name: str) -> Path:
    folder = Path(tempfile.mkdtemp())
    (folder / name).write_bytes(data)
    return folder / name


@FILES
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
@example(b"name: x\ntasks: [{task: arith_d1, limit: -1}]\n")
@example(b"a: &a [*a, *a]\n")
@example(b"\xff\xfe\x00")
@example(b"tasks: 3\n")
@example(b"name: x\ntasks: [{task: arith_d1}]\nsubnets: {specs: [d9]}\n")
def test_suite_yaml_loads_or_raises_config_error(data):
    from evals.suite import load_suite

    with contextlib.suppress(ConfigError):
        load_suite(_tmp(data, "suite.yaml"))


@FILES
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
@example(b"\xff\xfe{")  # not UTF-8: was a UnicodeDecodeError traceback
@example(b'{"fingerprint": 1}')
@example(b"[]")
def test_unit_files_read_or_are_recomputed(data):
    from evals.results import read_unit

    rec = read_unit(_tmp(data, "unit.json"))
    assert rec is None or isinstance(rec, dict)


@FILES
@given(st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode)))
@example(b"\xff")
@example(b'{"format": 1, "files": {"../../etc/passwd": {"sha256": "0", "bytes": 1}}}')
@example(b'{"format": 1, "files": []}')
@example(b'{"format": "1"}')
def test_checkpoint_meta_json_loads_or_raises_checkpoint_error(data):
    from ernie5.store.checkpoint import CheckpointError, load_checkpoint

    folder = _tmp(data, "meta.json").parent
    with pytest.raises(CheckpointError):
        load_checkpoint(folder)


def _wav(channels: int, width: int, rate: int, frames: bytes) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(frames)
    return buf.getvalue()


def _riff(fmt_chunk: bytes, data: bytes) -> bytes:
    body = (
        b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt_chunk))
        + fmt_chunk
        + b"data"
        + struct.pack("<I", len(data))
        + data
    )
    return b"RIFF" + struct.pack("<I", len(body)) + body


@FILES
@given(
    st.one_of(
        st.binary(max_size=200),
        st.builds(
            _riff,
            st.builds(
                lambda tag, ch, rate, width: struct.pack(
                    "<HHIIHH", tag, ch, rate, (rate * ch * width) & 0xFFFFFFFF, ch * width, 8 * width
                ),
                st.sampled_from([1, 3, 0xFFFE, 7]),
                st.integers(0, 8),
                st.sampled_from([0, 1, 8000, 16000, 44100, 2**31 - 1]),
                st.integers(0, 5),
            ),
            st.binary(max_size=64),
        ),
    )
)
@example(_riff(struct.pack("<HHIIHH", 1, 1, 0, 0, 2, 16), b"\x00\x01" * 4))  # rate 0
@example(_riff(struct.pack("<HHIIHH", 1, 1, 8000, 24000, 3, 24), b"\x00" * 7))  # 24-bit, torn frame
@example(_riff(struct.pack("<HHIIHH", 1, 0, 8000, 0, 0, 16), b""))  # no channels
@example(_riff(struct.pack("<HHIIHH", 1, 1, 2**31 - 1, 0, 2, 16), b"\x00\x01" * 4))  # asked for 128 GiB
@example(
    b"RIFF$\x00\x00\x00WAVEfm \x10\x00\x00\x00\x01\x00\x01\x00\xff\xff\xff\x7f\xff\xff\xff\x7f"
    b"\x01\x00\x08\x00data\x00\x00\x00\x00"
)  # a chunk running past the file: wave's RuntimeError
def test_wav_files_read_or_raise_data_corrupt(data):
    import numpy as np

    from ernie5.data.audio import read_wav

    try:
        x = read_wav(_tmp(data, "clip.wav"))
    except DataCorrupt as e:
        assert len(str(e).splitlines()) == 1
        return
    assert x.dtype == np.float32 and x.ndim == 1 and len(x) < 10_000_000


@pytest.fixture(scope="module")
def tokenizer():
    from ernie5.store.checkpoint import load_checkpoint

    return load_checkpoint("reference").tokenizer


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=80))
@example("\x00\x01\x1b[31m\u202e\ufeff\U0001f600")
@example("\r\n\t\x7f")
def test_prompts_with_any_unicode_round_trip_through_the_tokenizer(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids) == text
