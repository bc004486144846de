"""`moesweep --version`: the package version, the git commit of a checkout, and the libraries that decide
results (torch, transformers, lm-eval) as installed, each beside its pin in the checkout's lock."""

from __future__ import annotations

import re
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from orchestrator.stage import library_versions

ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str | None:
    """The checkout's short commit, with `+dirty` where tracked files changed; None outside a checkout."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def pins(path: Path) -> dict[str, str]:
    """{normalised distribution name: pinned version} of one requirements file (`name==version` lines)."""
    text = path.read_text() if path.is_file() else ""
    return {
        re.sub(r"[-_.]+", "-", m.group(1)).lower(): m.group(2)
        for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", text, re.M)
    }


def locked_versions(root: Path = ROOT) -> dict[str, str]:
    """{distribution: pinned version} from the checkout's requirements/ lock files (empty when there are none)."""
    return {**pins(root / "requirements" / "lock.txt"), **pins(root / "requirements" / "torch-cpu.txt")}


def version_text(root: Path = ROOT) -> str:
    try:
        own = version("moesweep")
    except PackageNotFoundError:
        own = "(not installed)"
    commit = git_commit(root)
    lines = [f"moesweep {own}" + (f" (git {commit})" if commit else "")]
    locked = locked_versions(root)
    for lib, have in library_versions().items():
        pin = locked.get(lib.replace("_", "-"))
        if pin is None:
            note = "" if locked else " (no lock file: not a checkout)"
        elif _public(pin) == _public(have):
            note = " (locked)"
        else:
            note = f" (the lock pins {pin})"
        lines.append(f"{lib.replace('_', '-')} {have}{note}")
    return "\n".join(lines)


def _public(v: str) -> str:
    """A version without its local label: torch 2.13.0+cpu and its CUDA build 2.13.0 are one locked release."""
    return v.split("+", 1)[0]
