"""Response cache: SQLite in WAL mode, keyed by model fingerprint + request, safe across processes.

The key is ``sha256(model fingerprint, request kind, canonical request)``. The model fingerprint
names the checkpoint *and* the concrete sub-model, so two sub-models never share an answer (the
trap of lm-eval's ``--use_cache``, whose key has no model identity). Each row stores the response
with its wall time and token counts (HELM-style), so efficiency columns can be recomputed and
re-scoring never needs re-inference.

Concurrency: WAL lets readers and one writer work at once; writers wait up to ``timeout`` seconds
for the lock (``busy_timeout``) and retry on ``database is locked`` (HELM #1914, lm-eval #796).
Each process opens its own connection.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import numpy as np

from evals.api import KIND_OF, REQUEST_KINDS, Answers, Cost, MediaPart, MediaResult, Request, Response

_BY_NAME = {k.name: k for k in REQUEST_KINDS}


def _encode_response(resp: Response) -> str:
    """JSON of a response; media arrays travel as base64 raw bytes with dtype and shape."""
    if isinstance(resp, MediaResult):
        arr = np.ascontiguousarray(resp.media)
        return json.dumps(
            {
                "media": {
                    "b64": base64.b64encode(arr.tobytes()).decode("ascii"),
                    "dtype": str(arr.dtype),
                    "shape": list(arr.shape),
                },
                "n_tokens": resp.n_tokens,
            }
        )
    return json.dumps(dataclasses.asdict(resp))


def _decode_response(kind: str, text: str) -> Response:
    obj = json.loads(text)
    if _BY_NAME[kind].media:
        m = obj["media"]
        arr = np.frombuffer(base64.b64decode(m["b64"]), dtype=m["dtype"]).reshape(m["shape"]).copy()
        return MediaResult(arr, obj.get("n_tokens", 0))
    return _BY_NAME[kind].result(**obj)


SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    kind TEXT NOT NULL,
    response TEXT NOT NULL,
    latency_s REAL NOT NULL,
    n_input_tokens INTEGER NOT NULL,
    n_output_tokens INTEGER NOT NULL,
    created REAL NOT NULL
)
"""


def _canonical(value: Any) -> Any:
    if isinstance(value, MediaPart):
        arr = np.ascontiguousarray(value.data)
        digest = hashlib.sha256(arr.tobytes() + str((arr.shape, arr.dtype)).encode()).hexdigest()
        return {"media": value.modality, "sha256": digest, "meta": _canonical(value.meta)}
    if isinstance(value, tuple | list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if dataclasses.is_dataclass(value):
        return {f.name: _canonical(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def request_kind(request: Request) -> str:
    """``loglikelihood`` | ``rolling`` | ``generate``."""
    return KIND_OF[type(request)].name


def request_key(model_fingerprint: str, request: Request) -> str:
    """The cache key of ``request`` answered by the model with ``model_fingerprint``."""
    body = json.dumps([model_fingerprint, request_kind(request), _canonical(request)], sort_keys=True)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()


_SQLITE_WRITE_ERRORS = {
    "database or disk is full": errno.ENOSPC,
    "disk i/o error": errno.EIO,
    "attempt to write a readonly database": errno.EROFS,
}


def _refused_write(e: sqlite3.OperationalError) -> int | None:
    """The errno of an SQLite error that is the disk refusing a write, else None."""
    text = str(e).lower()
    return next((code for msg, code in _SQLITE_WRITE_ERRORS.items() if msg in text), None)


class ResponseCache:
    """A SQLite response store (one connection per process)."""

    def __init__(self, path: str | Path, timeout: float = 60.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        self._retry(lambda: self.conn.execute("PRAGMA journal_mode=WAL"))
        self.conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self._retry(lambda: self.conn.execute(SCHEMA))

    def _retry(self, fn):
        """``fn()``, retried while another process holds the database; a write the disk refused
        (full, read-only, I/O error) becomes one ``OSError`` naming the cache file."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as e:
                refused = _refused_write(e)
                if refused is not None:
                    raise OSError(
                        refused, f"{os.strerror(refused)} while writing the response cache", str(self.path)
                    ) from None
                if "locked" not in str(e) and "busy" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def get_many(self, keys: list[str]) -> dict[str, tuple[Response, float, int, int]]:
        """Cached ``(response, latency_s, n_input_tokens, n_output_tokens)`` by key (misses absent)."""
        out: dict[str, tuple[Response, float, int, int]] = {}
        for start in range(0, len(keys), 500):
            chunk = keys[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self._retry(
                lambda c=chunk, m=marks: self.conn.execute(
                    f"SELECT key, kind, response, latency_s, n_input_tokens, n_output_tokens "
                    f"FROM responses WHERE key IN ({m})",
                    c,
                ).fetchall()
            )
            for key, kind, resp, lat, n_in, n_out in rows:
                out[key] = (_decode_response(kind, resp), lat, n_in, n_out)
        return out

    def put_many(self, rows: list[tuple[str, str, Request, Response, float, int, int]]) -> None:
        """Store ``(key, model_fingerprint, request, response, latency_s, n_in, n_out)`` rows atomically."""
        now = time.time()
        values = [
            (key, model, request_kind(req), _encode_response(resp), lat, n_in, n_out, now)
            for key, model, req, resp, lat, n_in, n_out in rows
        ]

        def write():
            with self.conn:  # one transaction
                self.conn.execute("BEGIN IMMEDIATE")
                self.conn.executemany("INSERT OR REPLACE INTO responses VALUES (?,?,?,?,?,?,?,?)", values)

        self._retry(write)

    def count(self, model_fingerprint: str | None = None) -> int:
        """Stored responses (of one model, or all)."""
        if model_fingerprint is None:
            return self.conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0]
        return self.conn.execute(
            "SELECT COUNT(*) FROM responses WHERE model=?", (model_fingerprint,)
        ).fetchone()[0]

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()


class CachedModel:
    """An EvalModel that answers from the cache and asks ``model`` only for misses.

    The answers carry the cached costs for hits and the model's for misses; ``model_s`` and
    ``routing`` are those of the call that answered the misses (a hit runs no forward)."""

    def __init__(self, model: Any, cache: ResponseCache | None) -> None:
        self.model = model
        self.cache = cache
        self.hits = 0
        self.misses = 0

    @property
    def fingerprint(self) -> str:  # noqa: D102
        return self.model.fingerprint

    def _call(self, requests: list[Request], method: str) -> Answers:
        if not hasattr(self.model, method):
            raise AttributeError(f"the model has no {method}() (e.g. no vision tokenizer or no refiner)")
        if self.cache is None:
            self.misses += len(requests)
            return getattr(self.model, method)(requests)
        fp = self.model.fingerprint
        keys = [request_key(fp, r) for r in requests]
        found = self.cache.get_many(list(dict.fromkeys(keys)))
        todo = [i for i, k in enumerate(keys) if k not in found]
        self.hits += len(requests) - len(todo)
        self.misses += len(todo)
        answers: dict[str, tuple[Response, Cost]] = {k: (v[0], Cost(*v[1:])) for k, v in found.items()}
        model_s, routing = 0.0, {}
        if todo:
            uniq = list(dict.fromkeys(keys[i] for i in todo))
            first = {k: next(i for i in todo if keys[i] == k) for k in uniq}
            reqs = [requests[first[k]] for k in uniq]
            got = getattr(self.model, method)(reqs)
            self.cache.put_many(
                [
                    (k, fp, rq, rs, c.latency_s, c.n_input_tokens, c.n_output_tokens)
                    for k, rq, rs, c in zip(uniq, reqs, got.results, got.costs, strict=True)
                ]
            )
            answers.update(zip(uniq, zip(got.results, got.costs, strict=True)))
            model_s, routing = got.model_s, got.routing
        return Answers(
            [answers[k][0] for k in keys], [answers[k][1] for k in keys], model_s=model_s, routing=routing
        )


def _answer_by_cache(method: str):
    def answer(self: CachedModel, requests: list[Request]) -> Answers:
        return self._call(requests, method)

    answer.__name__ = answer.__qualname__ = method
    answer.__doc__ = f"The model's ``{method}``, answered from the cache where it can be."
    return answer


for _kind in REQUEST_KINDS:  # one method per request kind, named as the EvalModel's
    setattr(CachedModel, _kind.method, _answer_by_cache(_kind.method))
