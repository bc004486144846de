"""Code versions that see the code: a job's key hashes the source of what computes it.

A job's code is the static closure of its stage's run function: that function's syntax tree plus,
recursively, every function, class and module-level constant of the project it names (through
module globals, `from x import y` at any level, and `module.attr` chains). Docstrings, comments,
formatting and the place of a definition in its file do not count; anything else does.

A definition is identified by its name and its normalised source, never by the module it lives in: the
digest lists (name, hash) pairs, and the hashed syntax of a definition drops the module paths of the
project's own imports inside it (`from workers.methods.scoring import sf` hashes as `from import sf`) and reads every
reference to a project definition by that definition's name (`workers.methods.scoring.sf`, `sc.sf`, an alias: `sf`). So moving code between modules keeps
every key, while an edit of any definition a job reaches, wherever it lives, changes it.

Method registries of the sweep's axes (SCORINGS, GROUPINGS, SCALINGS) are not followed from the
stage: each job adds one component per axis value it names (`scoring:SF` = the closure of the
registry entry `"SF": Scoring(sf)`). So editing one scoring changes the key of exactly the
conversions that use it; their plans, if they change, change every job downstream (a student is
keyed by its plan's content, so a code edit that leaves a plan bit-identical reuses its student).
Third-party code is covered by library versions in the key. Everything is read from the source
files without importing them, so planning a sweep imports no torch.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cache

from workers.core.registry import module_ast, module_path, registry_dict

PROJECT = frozenset({"workers", "orchestrator", "db", "analysis"})

# a unit is (module, top-level name) or (module, registry, entry name)
Unit = tuple[str, ...]


def _is_project(module: str, extra: frozenset[str]) -> bool:
    top = module.split(".")[0]
    return (top in PROJECT or top in extra) and module_path(module) is not None


def _strip_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (
            isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            n.body = body[1:] or [ast.Pass()]
    return node


def _sorted_import_runs(stmts: list[ast.stmt]) -> list[ast.stmt]:
    """`stmts` with every run of consecutive import statements sorted (their order does not change the code)."""
    out: list[ast.stmt] = []
    run: list[ast.stmt] = []
    for st in [*stmts, None]:
        if isinstance(st, ast.Import | ast.ImportFrom):
            run.append(st)
            continue
        out.extend(sorted(run, key=ast.dump))
        run = []
        if st is not None:
            out.append(st)
    return out


def _resolve_relative(module: str, level: int, target: str | None) -> str:
    if not level:
        return target or ""
    is_pkg = str(module_path(module) or "").endswith("__init__.py")
    parts = module.split(".")
    base = parts if is_pkg else parts[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str, nodes: Iterable[ast.stmt]) -> dict[str, tuple[str, str | None]]:
    """alias → (module, attribute or None for the module itself), for the import statements in `nodes`."""
    out: dict[str, tuple[str, str | None]] = {}
    for n in nodes:
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.asname:
                    out[a.asname] = (a.name, None)
                else:
                    out[a.name.split(".")[0]] = (a.name.split(".")[0], None)
        elif isinstance(n, ast.ImportFrom):
            src = _resolve_relative(module, n.level, n.module)
            for a in n.names:
                out[a.asname or a.name] = (src, a.name)
    return out


@dataclass
class _Scope:
    defs: dict[str, ast.AST] = field(default_factory=dict)
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)


@cache
def _scope(module: str) -> _Scope:
    scope = _Scope()

    def visit(body: list[ast.stmt]) -> None:
        for n in body:
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                scope.defs[n.name] = n
            elif isinstance(n, ast.Assign | ast.AnnAssign):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        scope.defs[t.id] = n
            elif isinstance(n, ast.If | ast.Try):
                visit(n.body)
                visit(getattr(n, "orelse", []))
                for h in getattr(n, "handlers", []):
                    visit(h.body)
        scope.imports.update(
            _imports(module, [n for n in body if isinstance(n, ast.Import | ast.ImportFrom)])
        )

    visit(module_ast(module).body)
    return scope


class Fingerprints:
    """Hashes of code closures; `stop` names registries that are never followed (the axes')."""

    def __init__(self, stop: Iterable[tuple[str, str]] = (), extra_roots: Iterable[str] = ()) -> None:
        self.stop = frozenset(stop)
        self.extra = frozenset(extra_roots)
        self._deps: dict[Unit, frozenset[Unit]] = {}
        self._hash: dict[Unit, str] = {}
        self._digest: dict[tuple[Unit, ...], str] = {}  # every job of a stage asks for the same closures

    # ---- one unit ------------------------------------------------------------------------------
    def node(self, unit: Unit) -> ast.AST:
        if len(unit) == 3:
            d = registry_dict(unit[0], unit[1])
            for k, v in zip(d.keys, d.values, strict=True):
                if k.value == unit[2]:  # type: ignore[union-attr]
                    return v
            raise KeyError(f"{unit[0]}.{unit[1]} has no entry {unit[2]!r}")
        return _scope(unit[0]).defs[unit[1]]

    def unit_hash(self, unit: Unit) -> str:
        if unit not in self._hash:
            text = ast.dump(self._without_module_paths(unit[0], _strip_docstrings(self.node(unit))))
            self._hash[unit] = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._hash[unit]

    def _without_module_paths(self, module: str, node: ast.AST) -> ast.AST:
        """`node` (a copy) with the project's module paths taken out of its imports and dotted chains."""
        local = _imports(module, [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)])
        fp = self
        tops = "|".join(sorted(PROJECT | self.extra))
        dotted = re.compile(rf"\b(?:{tops})(?:\.[A-Za-z_]\w*)+")

        def target(e: ast.AST):
            """What a name or dotted chain refers to in the project: ("unit", module, name), ("module", m), None."""
            if isinstance(e, ast.Name):
                return fp._resolve(module, e.id, local)
            if isinstance(e, ast.Attribute):
                outer = target(e.value)
                if outer is not None and outer[0] == "module":
                    return fp._in_module(outer[1], e.attr)
            return None

        def by_name(t, ctx: ast.expr_context) -> ast.Name:
            return ast.Name(id=t[2] if t[0] == "unit" else t[1].rsplit(".", 1)[-1], ctx=ctx)

        def module_prefix(m: re.Match) -> str:
            """A dotted project name in a string, its module part read by the module's last name."""
            parts = m.group(0).split(".")
            for cut in range(len(parts), 1, -1):
                if _is_project(".".join(parts[:cut]), fp.extra):
                    return ".".join([parts[cut - 1], *parts[cut:]])
            return m.group(0)

        class Strip(ast.NodeTransformer):
            def generic_visit(self, n: ast.AST) -> ast.AST:
                super().generic_visit(n)
                for name in ("body", "orelse", "finalbody"):  # a run of imports is read in sorted order
                    stmts = getattr(n, name, None)
                    if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                        setattr(n, name, _sorted_import_runs(stmts))
                return n

            def visit_Constant(self, n: ast.Constant) -> ast.AST:
                if isinstance(n.value, str) and dotted.search(n.value):
                    n.value = dotted.sub(module_prefix, n.value)
                return n

            def visit_ImportFrom(self, n: ast.ImportFrom) -> ast.AST:
                if n.level or _is_project(_resolve_relative(module, n.level, n.module), fp.extra):
                    n.module, n.level = None, 0
                return n

            def visit_Import(self, n: ast.Import) -> ast.AST:
                for a in n.names:
                    if _is_project(a.name, fp.extra):
                        a.name = a.name.rsplit(".", 1)[-1]
                return n

            def visit_Attribute(self, n: ast.Attribute) -> ast.AST:
                t = target(n)
                return by_name(t, n.ctx) if t is not None else self.generic_visit(n)

            def visit_Name(self, n: ast.Name) -> ast.AST:
                t = target(n) if isinstance(n.ctx, ast.Load) else None
                return by_name(t, n.ctx) if t is not None and t[0] == "unit" else n

        return Strip().visit(node)

    @staticmethod
    def unit_name(unit: Unit) -> str:
        """A unit as the digest names it: without its module (`sf`, `SCORINGS/SF`)."""
        return "/".join(unit[1:])

    def deps(self, unit: Unit) -> frozenset[Unit]:
        if unit not in self._deps:
            self._deps[unit] = frozenset(self._refs(unit[0], self.node(unit)))
        return self._deps[unit]

    # ---- closures ------------------------------------------------------------------------------
    def closure(self, roots: Iterable[Unit]) -> dict[Unit, str]:
        seen: dict[Unit, str] = {}
        todo = list(roots)
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen[u] = self.unit_hash(u)
            todo.extend(d for d in self.deps(u) if d not in seen)
        return seen

    def digest(self, roots: Iterable[Unit]) -> str:
        roots = tuple(roots)
        if roots not in self._digest:
            items = sorted((self.unit_name(u), h) for u, h in self.closure(roots).items())
            self._digest[roots] = hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
        return self._digest[roots]

    # ---- name resolution -------------------------------------------------------------------------
    def _refs(self, module: str, node: ast.AST) -> set[Unit]:
        local = _imports(module, [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)])
        out: set[Unit] = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Attribute):
                chain: list[str] = []
                cur: ast.AST = n
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name):
                    target = self._resolve(module, cur.id, local)
                    for attr in reversed(chain):
                        if target is None or target[0] != "module":
                            break
                        target = self._in_module(target[1], attr)
                    self._add(out, target)
            elif isinstance(n, ast.Name):
                self._add(out, self._resolve(module, n.id, local))
        return out

    def _add(self, out: set[Unit], target: tuple[str, ...] | None) -> None:
        if target is not None and target[0] == "unit" and (target[1], target[2]) not in self.stop:
            out.add((target[1], target[2]))

    def _resolve(self, module: str, name: str, local: dict[str, tuple[str, str | None]]):
        if name in local:
            return self._import_target(*local[name])
        scope = _scope(module)
        if name in scope.defs:
            return ("unit", module, name)
        if name in scope.imports:
            return self._import_target(*scope.imports[name])
        return None

    def _import_target(self, module: str, attr: str | None, depth: int = 0):
        if not _is_project(module, self.extra):
            return None
        if attr is None:
            return ("module", module)
        return self._in_module(module, attr, depth)

    def _in_module(self, module: str, attr: str, depth: int = 0):
        sub = f"{module}.{attr}"
        if _is_project(sub, self.extra) and attr not in _scope(module).defs:
            return ("module", sub)
        scope = _scope(module)
        if attr in scope.defs:
            return ("unit", module, attr)
        if attr in scope.imports and depth < 20:  # a name re-exported by `module`
            return self._import_target(*scope.imports[attr], depth=depth + 1)
        return None


def clear_caches() -> None:
    """Forget parsed sources (for a process that edits them, e.g. a test)."""
    from workers.core.registry import module_ast, module_path

    module_ast.cache_clear()
    module_path.cache_clear()
    _scope.cache_clear()
