"""Name → method lookups for the registries, and reading a registry's names without importing it.

A registry is a dict literal at the top level of its module (`SCORINGS = {"SF": Scoring(sf), ...}`).
Keeping it literal lets a sweep be planned and validated from the source alone: `registry_names`
parses the module file (no import, so no torch), and orchestrator.codever hashes one entry's code.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def lookup(registry: dict[str, T], name: str, what: str) -> T:
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(registry)}")
    return registry[name]


@cache
def module_path(module: str) -> Path | None:
    """The source file of `module` (a dotted name), found without importing it; None if there is none."""
    top, _, rest = module.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not spec.submodule_search_locations:
        return Path(spec.origin) if spec.origin and not rest else None
    base = Path(next(iter(spec.submodule_search_locations)))
    p = base.joinpath(*rest.split(".")) if rest else base
    if rest and p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    return p / "__init__.py" if (p / "__init__.py").is_file() else None


@cache
def module_ast(module: str) -> ast.Module:
    path = module_path(module)
    if path is None:
        raise ModuleNotFoundError(f"no source for module {module!r}")
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def registry_dict(module: str, name: str) -> ast.Dict:
    """The dict literal assigned to `name` at the top level of `module`."""
    for node in module_ast(module).body:
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            if not isinstance(node.value, ast.Dict) or not all(
                isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.value.keys
            ):
                raise ValueError(f"{module}.{name}: a registry must be a dict literal with string keys")
            return node.value
    raise ValueError(f"{module}: no registry {name!r} at the top level")


def registry_names(module: str, name: str) -> list[str]:
    """The names a registry declares, in order, read from its module's source (nothing is imported)."""
    return [k.value for k in registry_dict(module, name).keys]  # type: ignore[union-attr]
