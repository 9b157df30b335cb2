"""Sub-model specs: what a user writes, its string forms, and its one resolution against a model.

A :class:`SubnetSpec` names dimensions as absolute counts or fractions, plus how the deploy-time
subset is chosen. :func:`resolve` turns it into the concrete :class:`~ernie5.model.elastic.Subnet`
of one model config (kept layer indices, kept experts per MoE layer, top-k) that
``Ernie5Model.forward`` takes as an argument.

String forms (all parse to the same spec):
  * ``full``
  * long: ``depth=0.75,width=0.5,top_k=2,layers=even,experts=random:0``
  * compact: ``d0.75-w0.5-k2-Leven-Erandom0`` (no ``,``, ``=`` or ``:``, so it survives lm-eval's
    ``--model_args`` and folder names). An int is an absolute count; a float in (0, 1] a fraction.

Deploy-time choice of what is kept:
  * ``layers``: ``even`` (evenly spaced, first and last kept; default), ``prefix`` (first n),
    ``random:SEED`` (first and last kept, a seeded random subset of the middle), ``importance``
    (highest block-influence layers, ShortGPT-style, from calibration statistics).
  * ``experts``: ``random:SEED`` (a seeded random subset per layer; default ``random:0``, the
    training-time distribution) or ``importance`` (most frequently routed experts per layer).

Importance-based selections need calibration statistics of the model's weights
(:mod:`ernie5.subnets.importance`), and the rule for when they are needed is here and nowhere else
(:func:`needs_calibration`): only when a spec selects by importance along a dimension it actually
reduces. The sweep, the suite loader's sub-models, the elastic study and the lm-eval bridge resolve
against a loaded checkpoint through :func:`resolve_specs`, which calibrates at most once for all the
specs it is given; ``generate`` and ``extract`` load and resolve through :func:`load_subnet`;
``params``, which needs only a config, through :func:`resolve_subnet`, which loads the checkpoint's
weights only when the spec needs calibration.

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (elastic depth, width, sparsity), §6.4.2.
  * Once-for-All (arXiv 1908.09791); ShortGPT block influence (arXiv 2403.03853).

Deviations:
  1. The report does not say which layers are skipped or which experts are kept at deploy time;
     both are selectable, with the defaults above, and the harness sweeps them.
  2. Hidden-size elasticity is not a dimension of a spec (the report does not use it either).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ernie5.model.config import ModelConfig
from ernie5.model.elastic import Subnet
from ernie5.store.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from ernie5.subnets.importance import Importance, calibration_batches, compute_importance

_LAYER_SELECTIONS = ("even", "prefix", "importance")
_EXPERT_SELECTIONS = ("importance",)


class SubnetError(ValueError):
    """A subnet spec that cannot be parsed or does not fit the model."""


def _check_selection(value: str, kind: str) -> str:
    allowed = _LAYER_SELECTIONS if kind == "layers" else _EXPERT_SELECTIONS
    if value in allowed or re.fullmatch(r"random:\d+", value):
        return value
    raise SubnetError(f"{kind}={value!r} is not one of {', '.join(allowed)}, random:SEED")


@dataclass(frozen=True, slots=True)
class SubnetSpec:
    """A user-level description of a sub-model; ``None`` dimensions mean "as in the full model"."""

    depth: int | float | None = None
    width: int | float | None = None
    top_k: int | float | None = None
    layers: str = "even"
    experts: str = "random:0"

    def __post_init__(self) -> None:
        for name in ("depth", "width", "top_k"):
            v = getattr(self, name)
            if isinstance(v, float) and v == 1.0:
                object.__setattr__(self, name, None)  # "100 %" is the full dimension
                continue
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise SubnetError(f"{name}={v!r} must be an int count or a float fraction")
            if isinstance(v, float) and not 0.0 < v <= 1.0:
                raise SubnetError(f"{name}={v} must be a fraction in (0, 1] or an int count")
            if isinstance(v, int) and v < 1:
                raise SubnetError(f"{name}={v} must be >= 1")
        _check_selection(self.layers, "layers")
        _check_selection(self.experts, "experts")

    @property
    def is_full(self) -> bool:
        """True when no dimension is reduced (selection options are then irrelevant)."""
        return all(self._unset(getattr(self, n)) for n in ("depth", "width", "top_k"))

    @staticmethod
    def _unset(v: int | float | None) -> bool:
        return v is None or (isinstance(v, float) and v == 1.0)

    def compact(self) -> str:
        """Compact string form, e.g. ``d0.75-w0.5-k2``; ``full`` for the full model."""
        if self.is_full:
            return "full"
        parts = []
        for letter, name in (("d", "depth"), ("w", "width"), ("k", "top_k")):
            v = getattr(self, name)
            if not self._unset(v):
                parts.append(f"{letter}{_fmt(v)}")
        if not self._unset(self.depth) and self.layers != "even":
            parts.append("L" + self.layers.replace(":", ""))
        if not self._unset(self.width) and self.experts != "random:0":
            parts.append("E" + self.experts.replace(":", ""))
        return "-".join(parts)

    def long(self) -> str:
        """Long string form, e.g. ``depth=0.75,width=0.5,top_k=2``."""
        if self.is_full:
            return "full"
        parts = [
            f"{n}={_fmt(getattr(self, n))}"
            for n in ("depth", "width", "top_k")
            if not self._unset(getattr(self, n))
        ]
        if not self._unset(self.depth) and self.layers != "even":
            parts.append(f"layers={self.layers}")
        if not self._unset(self.width) and self.experts != "random:0":
            parts.append(f"experts={self.experts}")
        return ",".join(parts)

    def __str__(self) -> str:
        return self.compact()


def _fmt(v: int | float) -> str:
    return str(v) if isinstance(v, int) else repr(float(v))


def _number(text: str, key: str) -> int | float:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise SubnetError(f"{key}={text!r} is not a number") from None


def parse_subnet(text: str | SubnetSpec | None) -> SubnetSpec:
    """Parse ``full``, the long form or the compact form into a :class:`SubnetSpec`."""
    if isinstance(text, SubnetSpec):
        return text
    if text is None:
        return SubnetSpec()
    s = text.strip()
    if s in ("", "full"):
        return SubnetSpec()
    kwargs: dict[str, object] = {}
    if "=" in s:
        names = {
            "depth": "depth",
            "width": "width",
            "top_k": "top_k",
            "k": "top_k",
            "layers": "layers",
            "experts": "experts",
        }
        for item in s.split(","):
            if "=" not in item:
                raise SubnetError(f"subnet {text!r}: {item!r} is not key=value")
            key, value = (p.strip() for p in item.split("=", 1))
            if key not in names:
                raise SubnetError(
                    f"subnet {text!r}: unknown key {key!r} (depth, width, top_k, layers, experts)"
                )
            name = names[key]
            kwargs[name] = value if name in ("layers", "experts") else _number(value, key)
    else:
        for part in s.split("-"):
            m = re.fullmatch(r"([dwkLE])(.+)", part)
            if not m:
                raise SubnetError(
                    f"subnet {text!r}: cannot parse {part!r} (expected d<n>, w<n>, k<n>, L<sel>, E<sel>)"
                )
            letter, value = m.groups()
            if letter in "dwk":
                kwargs[{"d": "depth", "w": "width", "k": "top_k"}[letter]] = _number(value, letter)
            else:
                sel = re.sub(r"^random(\d+)$", r"random:\1", value)
                kwargs["layers" if letter == "L" else "experts"] = sel
    try:
        return SubnetSpec(**kwargs)  # type: ignore[arg-type]
    except SubnetError as e:
        raise SubnetError(f"subnet {text!r}: {e}") from None


def select_count(v: int | float | None, full: int, name: str) -> int:
    """How many of ``full`` a spec dimension keeps: all for None, a count as given, a fraction
    rounded (at least 1)."""
    if v is None:
        return full
    n = max(1, round(v * full)) if isinstance(v, float) else v
    if n > full:
        raise SubnetError(f"{name}={v} exceeds the model's {full}")
    return n


def select_layers(
    n_layers: int, n_keep: int, how: str, importance: list[float] | None = None
) -> tuple[int, ...]:
    """Which ``n_keep`` of ``n_layers`` layers to keep (ascending indices)."""
    if n_keep >= n_layers:
        return tuple(range(n_layers))
    if how == "prefix":
        return tuple(range(n_keep))
    if how == "even":
        if n_keep == 1:
            return (n_layers - 1,)
        return tuple(sorted({round(i * (n_layers - 1) / (n_keep - 1)) for i in range(n_keep)}))
    if how.startswith("random:"):
        rng = random.Random(int(how.split(":")[1]))
        if n_keep == 1:
            return (n_layers - 1,)
        middle = rng.sample(range(1, n_layers - 1), n_keep - 2)
        return tuple(sorted([0, n_layers - 1, *middle]))
    if how == "importance":
        if importance is None or len(importance) != n_layers:
            raise SubnetError("layers=importance needs layer importance statistics (run calibration first)")
        top = sorted(range(n_layers), key=lambda i: (-importance[i], i))[:n_keep]
        return tuple(sorted(top))
    raise SubnetError(f"layers={how!r} is not a known selection")


def select_experts(
    n_experts: int, n_keep: int, how: str, layer: int, frequency: list[float] | None = None
) -> tuple[int, ...] | None:
    """Which routed experts of ``layer`` stay available (None = all)."""
    if n_keep >= n_experts:
        return None
    if how.startswith("random:"):
        rng = random.Random(int(how.split(":")[1]) * 100_003 + layer)
        return tuple(sorted(rng.sample(range(n_experts), n_keep)))
    if how == "importance":
        if frequency is None or len(frequency) != n_experts:
            raise SubnetError("experts=importance needs routing frequency statistics (run calibration first)")
        top = sorted(range(n_experts), key=lambda e: (-frequency[e], e))[:n_keep]
        return tuple(sorted(top))
    raise SubnetError(f"experts={how!r} is not a known selection")


def resolve(spec: SubnetSpec | str, cfg: ModelConfig, importance: Importance | None = None) -> Subnet:
    """Turn a spec into a concrete :class:`Subnet` of a model with config ``cfg``."""
    spec = parse_subnet(spec)
    if spec.is_full:
        return Subnet.full(cfg)
    e = cfg.moe.n_experts
    n_depth = select_count(spec.depth, cfg.n_layers, "depth")
    n_width = select_count(spec.width, e, "width")
    if isinstance(spec.top_k, float):
        top_k = max(1, round(spec.top_k * cfg.moe.top_k))
    else:
        top_k = spec.top_k or cfg.moe.top_k
    if top_k > n_width:
        raise SubnetError(f"top_k={top_k} exceeds the {n_width} experts available (width={spec.width})")
    layers = select_layers(
        cfg.n_layers, n_depth, spec.layers, list(importance.layer_influence) if importance else None
    )
    experts = []
    for i in range(cfg.n_layers):
        if not cfg.is_moe_layer(i):
            experts.append(None)
            continue
        freq = importance.expert_frequency[i] if importance else None
        experts.append(select_experts(e, n_width, spec.experts, i, list(freq) if freq else None))
    return Subnet(layers, tuple(experts), top_k, spec.compact())


def needs_calibration(spec: SubnetSpec, cfg: ModelConfig) -> bool:
    """Whether resolving ``spec`` against a model with ``cfg`` needs importance statistics: it keeps
    fewer layers than the model has and selects them by importance, or fewer experts and selects
    those by importance."""
    fewer_layers = select_count(spec.depth, cfg.n_layers, "depth") < cfg.n_layers
    fewer_experts = select_count(spec.width, cfg.moe.n_experts, "width") < cfg.moe.n_experts
    return (fewer_layers and spec.layers == "importance") or (fewer_experts and spec.experts == "importance")


def resolve_specs(
    specs: Sequence[SubnetSpec | str], ckpt: Checkpoint, data_dir: str | Path | None = None
) -> list[Subnet]:
    """The concrete sub-models of ``specs`` for ``ckpt``'s model, in order.

    Calibrates importance once (on :func:`~ernie5.subnets.importance.calibration_batches`) when
    any spec needs it.

    Raises:
        SubnetError: a spec that does not parse or does not fit the model.
        CheckpointError: importance selection on a checkpoint without a tokenizer.
    """
    parsed = [parse_subnet(s) for s in specs]
    importance = None
    if any(needs_calibration(s, ckpt.cfg) for s in parsed):
        if ckpt.tokenizer is None:
            raise CheckpointError(f"{ckpt.path}: importance selection needs the checkpoint's tokenizer")
        importance = compute_importance(ckpt.model, calibration_batches(ckpt.tokenizer, data_dir))
    return [resolve(s, ckpt.cfg, importance) for s in parsed]


def load_subnet(
    checkpoint: str | Path, subnet: str | SubnetSpec | None, data_dir: str | Path | None = None
) -> tuple[Checkpoint, Subnet]:
    """Load a checkpoint (or a run folder's newest one) and resolve ``subnet`` against it."""
    ckpt = load_checkpoint(checkpoint)
    (sub,) = resolve_specs([parse_subnet(subnet)], ckpt, data_dir)
    return ckpt, sub


def resolve_subnet(
    spec: str | SubnetSpec | None,
    cfg: ModelConfig,
    checkpoint: str | Path | None = None,
    data_dir: str | Path | None = None,
) -> Subnet:
    """The concrete sub-model of ``spec`` for a model with ``cfg``, from the config alone when the spec
    needs no calibration (:func:`needs_calibration`), else against the weights of ``checkpoint`` (a
    checkpoint folder, a run folder or a shipped name), which is loaded only then.

    Raises:
        SubnetError: a spec that does not parse or does not fit the model, or one that selects by
            importance without a ``checkpoint``.
        CheckpointError: the checkpoint cannot be loaded or has no tokenizer for calibration.
    """
    spec = parse_subnet(spec)
    if checkpoint is not None and needs_calibration(spec, cfg):
        (sub,) = resolve_specs([spec], load_checkpoint(checkpoint), data_dir)  # importance needs the weights
        return sub
    return resolve(spec, cfg)
