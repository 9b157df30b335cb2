"""Elastic sub-models: which layers run, which routed experts are available, and top-k.

A :class:`SubnetSpec` is what a user writes: dimensions as absolute counts or fractions, plus how
the deploy-time subset is chosen. :func:`resolve` turns it into a concrete :class:`Subnet` for one
model (kept layer indices, kept experts per MoE layer, top-k) that ``Ernie5Model.forward`` takes as
an argument. The model is never mutated; ``Subnet.full`` runs exactly the plain forward.

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

References:
  * ERNIE 5.0 Technical Report (arXiv 2602.04705) §3.3 (elastic depth, width, sparsity), §6.4.2.
  * Once-for-All (arXiv 1908.09791); ShortGPT block influence (arXiv 2403.03853).

Deviations:
  1. The report does not say which layers are skipped or which experts are kept at deploy time;
     both are selectable, with the defaults above, and the harness sweeps them.
  2. Hidden-size elasticity is not supported (the report does not use it either).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch

from ernie5.model.config import ModelConfig

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


@dataclass(frozen=True, slots=True)
class Subnet:
    """A concrete sub-model of one model: what ``Ernie5Model.forward`` runs."""

    layers: tuple[int, ...]
    """Kept layer indices, ascending."""
    experts: tuple[tuple[int, ...] | None, ...]
    """Per layer: the routed experts available, or None for all of them."""
    top_k: int
    """Active routed experts per token."""
    name: str = "full"
    """Compact spec this came from, or a description of a sampled subnet."""
    _masks: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @staticmethod
    def full(cfg: ModelConfig) -> Subnet:
        """The whole model."""
        return Subnet(tuple(range(cfg.n_layers)), (None,) * cfg.n_layers, cfg.moe.top_k, "full")

    def is_full_for(self, cfg: ModelConfig) -> bool:
        """True when this subnet is the whole of ``cfg``'s model."""
        return (
            self.layers == tuple(range(cfg.n_layers))
            and all(e is None for e in self.experts)
            and self.top_k == cfg.moe.top_k
        )

    def expert_mask(self, layer: int, n_experts: int, device: torch.device) -> torch.Tensor | None:
        """Boolean availability mask of ``layer``'s routed experts (None = all available)."""
        kept = self.experts[layer]
        if kept is None:
            return None
        key = (layer, str(device))
        if key not in self._masks:
            mask = torch.zeros(n_experts, dtype=torch.bool, device=device)
            mask[list(kept)] = True
            self._masks[key] = mask
        return self._masks[key]

    def n_experts_kept(self, layer: int, n_experts: int) -> int:
        """Routed experts available at ``layer``."""
        kept = self.experts[layer]
        return n_experts if kept is None else len(kept)


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


@dataclass(frozen=True, slots=True)
class Importance:
    """Calibration statistics for importance-based deploy selection."""

    layer_influence: tuple[float, ...]
    """Block influence per layer: mean ``1 - cos(h_in, h_out)`` (ShortGPT)."""
    expert_frequency: tuple[tuple[float, ...] | None, ...]
    """Per layer, fraction of routed pairs per expert (None for dense layers)."""


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
