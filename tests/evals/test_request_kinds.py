"""The one table of request kinds (evals.api.REQUEST_KINDS) and the three that implement it."""

from __future__ import annotations

import inspect
import typing

import numpy as np
import pytest

from evals.adapter import Ernie5EvalModel
from evals.api import (
    KIND_OF,
    REQUEST_KINDS,
    GenerationRequest,
    LoglikelihoodRequest,
    MediaGenerationRequest,
    MediaPart,
    ReconstructionRequest,
    RefineRequest,
    Request,
    RollingRequest,
    SpeechGenerationRequest,
)
from evals.cache import CachedModel, ResponseCache, request_kind
from evals.random_model import RandomModel

IMAGE = MediaPart("image", np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3))
ONE_OF_EACH = {
    LoglikelihoodRequest: LoglikelihoodRequest("2+2=", " 4"),
    RollingRequest: RollingRequest("a whole document"),
    GenerationRequest: GenerationRequest("Q: 1+1\nA:", max_new_tokens=4, stop=("\n",)),
    MediaGenerationRequest: MediaGenerationRequest("a red circle", n_frames=2),
    SpeechGenerationRequest: SpeechGenerationRequest("three", max_frames=8),
    ReconstructionRequest: ReconstructionRequest(MediaPart("audio", np.zeros(800, np.float32))),
    RefineRequest: RefineRequest(IMAGE),
}


def test_the_table_names_every_request_type_once():
    assert {k.request for k in REQUEST_KINDS} == set(typing.get_args(Request)) == set(ONE_OF_EACH)
    for field in ("name", "method", "request"):
        values = [getattr(k, field) for k in REQUEST_KINDS]
        assert len(set(values)) == len(values), field
    assert [k.name for k in REQUEST_KINDS if k.media] == [
        "generate_media",
        "generate_speech",
        "reconstruct",
        "refine",
    ]


@pytest.mark.parametrize("implementer", [Ernie5EvalModel, RandomModel, CachedModel])
def test_every_implementer_answers_every_kind(implementer):
    for kind in REQUEST_KINDS:
        method = getattr(implementer, kind.method, None)
        assert callable(method), f"{implementer.__name__} has no {kind.method}()"
        assert list(inspect.signature(method).parameters)[1:] == ["requests"], (implementer, kind.method)


def test_the_cache_answers_every_kind_as_the_model_does_and_stores_its_name(tmp_path):
    model = RandomModel(seed=3)
    cached = CachedModel(model, ResponseCache(tmp_path / "cache.sqlite"))
    for request_type, request in ONE_OF_EACH.items():
        kind = KIND_OF[request_type]
        assert request_kind(request) == kind.name
        direct = getattr(model, kind.method)([request]).results[0]
        miss = getattr(cached, kind.method)([request]).results[0]
        hit = getattr(cached, kind.method)([request]).results[0]  # decoded from the cache's row
        assert type(direct) is type(hit) is kind.result
        for got in (miss, hit):
            if kind.media:
                np.testing.assert_array_equal(got.media, direct.media)
                assert got.media.dtype == direct.media.dtype and got.n_tokens == direct.n_tokens
            else:
                assert got == direct
    assert cached.misses == cached.hits == len(ONE_OF_EACH)
    rows = cached.cache.conn.execute("SELECT DISTINCT kind FROM responses").fetchall()
    assert {r[0] for r in rows} == {k.name for k in REQUEST_KINDS}
