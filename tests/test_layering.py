"""One-way flow: analysis reads the database only and never imports the workers; the workers never import
the orchestrator or the database (they take plain inputs and return plain records)."""

from __future__ import annotations

import ast
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
        found = sorted(m for m in imported_modules(f.read_text(), rel[:-1])
                       if m.split(".")[0] in ("orchestrator", "db"))
        if found:
            bad[f.relative_to(ROOT).as_posix()] = found
    assert bad == {}


def test_the_check_sees_every_import_form():
    src = "import os, workers.stages\nfrom workers import x\ndef f():\n    from workers.y import z\n"
    assert workers_imports(src, ("analysis",)) == [
        "workers",
        "workers.stages",
        "workers.x",
        "workers.y",
        "workers.y.z",
    ]
    assert "analysis.derived" in imported_modules("from . import derived\n", ("analysis",))
    assert (
        workers_imports("from db.select_rule import select_best_rows\nimport pandas\n", ("analysis",)) == []
    )
