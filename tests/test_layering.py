"""One-way flow: analysis reads the database only and never imports the workers; the workers never import
the orchestrator or the database (they take plain inputs and return plain records); inside workers/ the wings
import one way (run > training, calibration, evaluation, baselines > models > families > methods > core); and
no module of the house imports itself back through others."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_modules(source: str, package: tuple[str, ...]) -> set[str]:
    """Every module a file imports, at any depth (relative imports resolved inside `package`)."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base, node.module or "") if p)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return out


def workers_imports(source: str, package: tuple[str, ...]) -> list[str]:
    return sorted(m for m in imported_modules(source, package) if m == "workers" or m.startswith("workers."))


def test_no_analysis_module_imports_workers():
    files = sorted((ROOT / "analysis").rglob("*.py"))
    assert len(files) >= 8
    bad = {}
    for f in files:
        rel = f.relative_to(ROOT).with_suffix("").parts
        if found := workers_imports(f.read_text(), rel[:-1]):
            bad[f.relative_to(ROOT).as_posix()] = found
    assert bad == {}


def test_no_worker_module_imports_the_orchestrator_or_the_database():
    files = sorted((ROOT / "workers").rglob("*.py"))
    assert len(files) >= 30
    bad = {}
    for f in files:
        rel = f.relative_to(ROOT).with_suffix("").parts
        found = sorted(
            m for m in imported_modules(f.read_text(), rel[:-1]) if m.split(".")[0] in ("orchestrator", "db")
        )
        if found:
            bad[f.relative_to(ROOT).as_posix()] = found
    assert bad == {}


def test_the_check_sees_every_import_form():
    src = "import os, workers.run.convert\nfrom workers import x\ndef f():\n    from workers.y import z\n"
    assert workers_imports(src, ("analysis",)) == [
        "workers",
        "workers.run.convert",
        "workers.x",
        "workers.y",
        "workers.y.z",
    ]
    assert "analysis.derived" in imported_modules("from . import derived\n", ("analysis",))
    assert (
        workers_imports("from db.select_rule import select_best_rows\nimport pandas\n", ("analysis",)) == []
    )


# ---- the wings of workers/ ------------------------------------------------------------------------------
# a wing may import only wings of a lower rank (never one of its own rank: those are siblings)
WING_RANK = {
    "core": 0,
    "methods": 1,
    "families": 2,
    "models": 3,
    "calibration": 4,
    "training": 4,
    "evaluation": 4,
    "baselines": 4,
    "tiny": 5,
    "run": 6,
}
PACKAGES = ("orchestrator", "workers", "db", "analysis", "dashboard", "sweeps")


def wing_violations(path: tuple[str, ...], imports: Iterable[str]) -> list[str]:
    """The imports of the module at `path` (its parts, e.g. ("workers", "methods", "scoring")) that point at
    its own or a higher wing."""
    if len(path) < 3 or path[0] != "workers":
        return []
    own = path[1]
    bad = []
    for m in imports:
        parts = m.split(".")
        if parts[0] == "workers" and len(parts) > 1 and parts[1] in WING_RANK and parts[1] != own:
            if WING_RANK[parts[1]] >= WING_RANK[own]:
                bad.append(m)
    return sorted(bad)


def test_every_worker_module_lives_in_a_wing():
    loose = sorted(f.name for f in (ROOT / "workers").glob("*.py") if f.name != "__init__.py")
    assert loose == []
    wings = sorted(d.name for d in (ROOT / "workers").iterdir() if (d / "__init__.py").is_file())
    assert wings == sorted(WING_RANK)


def test_the_wings_import_one_way():
    bad = {}
    for f in sorted((ROOT / "workers").rglob("*.py")):
        rel = f.relative_to(ROOT).with_suffix("").parts
        if found := wing_violations(rel, imported_modules(f.read_text(), rel[:-1])):
            bad[f.relative_to(ROOT).as_posix()] = found
    assert bad == {}


def test_the_wing_check_sees_a_back_up_and_a_sideways_import():
    assert wing_violations(("workers", "methods", "scoring"), ["workers.core.types", "torch"]) == []
    assert wing_violations(("workers", "methods", "scoring"), ["workers.calibration.calibrate"]) == [
        "workers.calibration.calibrate"
    ]
    assert wing_violations(("workers", "training", "distill"), ["workers.evaluation.ppl"]) == [
        "workers.evaluation.ppl"
    ]
    assert (
        wing_violations(("workers", "run", "convert"), ["workers.models.plans", "workers.run.common"]) == []
    )


# ---- no circles ------------------------------------------------------------------------------------------
def module_graph() -> dict[str, set[str]]:
    """module → the project modules it imports (at any depth), over every package of the house."""
    files = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            parts = f.relative_to(ROOT).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def owner(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for mod, f in files.items():
        package = tuple(mod.split(".")) if f.name == "__init__.py" else tuple(mod.split(".")[:-1])
        targets = {owner(m) for m in imported_modules(f.read_text(), package)}
        graph[mod] = {t for t in targets if t and t != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_back():
    assert circles(module_graph()) == []


def test_the_circle_check_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# ---- the dashboard reads the database only ---------------------------------------------------------------
def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def test_no_dashboard_module_imports_the_orchestrator():
    """Not directly, nor through the modules it imports: what it shows (stage order included) comes from
    the database."""
    graph = module_graph()
    mods = sorted(m for m in graph if m == "dashboard" or m.startswith("dashboard."))
    assert len(mods) >= 5
    bad = {
        m: sorted(r for r in reachable(graph, m) if r == "orchestrator" or r.startswith("orchestrator."))
        for m in mods
    }
    assert {m: r for m, r in bad.items() if r} == {}
    assert reachable({"a": {"b"}, "b": {"orchestrator.stage"}}, "a") == {"b", "orchestrator.stage"}
