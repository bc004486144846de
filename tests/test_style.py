"""The house style, checked with the suite (so CI checks it): `ruff check` and `ruff format --check` clean,
and no history comments in code (the issue tracker and the commit log keep the history)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")
HISTORY = re.compile(r"#.*\bissue #?\d+|\"\"\".*\bissue #\d+", re.IGNORECASE)


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_check_is_clean():
    got = _ruff("check", ".")
    assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-2000:]


def test_ruff_format_is_clean():
    got = _ruff("format", "--check", ".")
    assert got.returncode == 0, "run `.venv/bin/ruff format .`:\n" + got.stdout[-4000:] + got.stderr[-2000:]


def history_lines(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_no_history_comments_in_code():
    files = subprocess.run(
        ["git", "ls-files", "*.py", "*.yaml", "*.html"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    here = Path(__file__).resolve()
    bad = [
        f"{f}:{n}"
        for f in files
        if (ROOT / f).resolve() != here
        for n in history_lines((ROOT / f).read_text())
    ]
    assert not bad, f"history comments (say what the code is, not which issue brought it): {bad}"


def test_the_history_check_sees_one():
    assert history_lines("x = 1  # issue #17, second batch\ny = 2  # the issue of ties\n") == [1]
