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
    return [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".toml")
            and not skip & set(p.relative_to(ROOT).parts)]


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
    hits = [f"{f.relative_to(ROOT)}:{n}" for f in _files() if f.name != "test_docs.py"
            for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, hits
