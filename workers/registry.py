"""Name → method lookups for the registries (scoring, grouping, scaling), with one error wording."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, T], name: str, what: str) -> T:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(registry)}")
    return registry[name]
