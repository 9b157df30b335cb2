"""A small generic registry for named plug-ins (tasks, tokenizers, rewards)."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> object mapping filled by the ``register`` decorator; duplicates are errors."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering its target under ``name``."""

        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``; a KeyError suggests close names."""
        if name not in self._items:
            close = difflib.get_close_matches(name, self._items, n=3, cutoff=0.5)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise KeyError(f"unknown {self.kind} {name!r}{hint}")
        return self._items[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)
