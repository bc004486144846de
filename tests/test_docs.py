"""The repository stands alone: every file path its documentation and code mention exists, and nothing
points at documents outside it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w./$<>{}-])((?:[a-z_][\w-]*/)+[\w-]+\.(?:py|md|yaml|csv|sql|ini))\b")
TOP = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")}
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|\bresearch/[\w-]+\.md|\bseeds/0\d\d")


def _files() -> list[Path]:
    skip = {".git", ".venv", "node_modules", "__pycache__", ".moesweep", "report"}
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and p.suffix in (".py", ".md", ".yaml", ".toml")
        and not skip & set(p.relative_to(ROOT).parts)
    ]


def test_every_mentioned_path_exists():
    missing = []
    for f in _files():
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            for m in PATH.finditer(line):
                ref = m.group(1)
                if ref.split("/")[0] not in TOP or "NAME" in ref:
                    continue  # another project's file (a library's, the standard library's) or a pattern
                if not (ROOT / ref).exists() and not (f.parent / ref).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{n}: {ref}")
    assert not missing, "\n".join(missing)


def test_nothing_points_outside_the_repository():
    hits = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in _files()
        if f.name != "test_docs.py"
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, hits


def layout_block(readme: str) -> str:
    section = readme[readme.index("## Layout") :]
    start = section.index("```") + 3
    return section[start : section.index("```", start)]


def must_name() -> list[str]:
    """What the Layout (docs/internals.md) must name: every top-level folder, every package of the product
    (as `name/`), and every module of the orchestrator, db, analysis, dashboard and each wing of workers
    (families' adapters are one per MoE family and named by the family table instead)."""
    names = [
        "sweeps/",
        "orchestrator/",
        "workers/",
        "db/",
        "analysis/",
        "dashboard/",
        "tests/",
        "benchmarks/",
        "requirements/",
        "scripts/",
        "docs/",
    ]
    for pkg in ("orchestrator", "workers", "db", "analysis", "dashboard"):
        for init in sorted((ROOT / pkg).rglob("__init__.py")):
            d = init.parent
            if d != ROOT / pkg and "migrations" not in d.relative_to(ROOT).parts[1:-1]:
                names.append(d.name + "/")
            if d.name == "families" or "migrations" in d.parts:
                continue
            names += [f.stem for f in sorted(d.glob("*.py")) if f.name != "__init__.py"]
    return names


def test_the_layout_names_every_package_and_module():
    block = layout_block((ROOT / "docs" / "internals.md").read_text())
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*/?", block))
    missing = [n for n in must_name() if n not in words]
    assert not missing, f"docs/internals.md ## Layout does not name: {missing}"


def test_the_layout_check_sees_a_missing_module():
    names = must_name()
    assert "scoring" in names and "core/" in names and "plans" in names and "qwen3_moe" not in names
    block = layout_block("## Layout\n```\nworkers/  core/ scoring\n```\n")
    assert "plans" not in set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*/?", block))
