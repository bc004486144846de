"""`moesweep --version`: package version, the checkout's commit, and torch/transformers/lm-eval beside the lock."""

from __future__ import annotations

import importlib.metadata as md
import subprocess

from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.version import ROOT, git_commit, locked_versions, version_text


def test_version_prints_the_package_the_commit_and_the_locked_libraries():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"moesweep {md.version('moesweep')}")
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert f"(git {head}" in lines[0]
    assert [ln.split()[0] for ln in lines[1:]] == ["torch", "transformers", "lm-eval"]
    assert lines[2] == f"transformers {md.version('transformers')} (locked)"  # the suite runs in the lock


def test_a_library_away_from_its_pin_is_named(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "lock.txt").write_text(
        "transformers==0.0.1 \\\n    --hash=sha256:00\nlm-eval==" + md.version("lm_eval") + "\n"
    )
    (tmp_path / "requirements" / "torch-cpu.txt").write_text(
        "torch==" + md.version("torch").split("+")[0] + "\n"
    )
    assert locked_versions(tmp_path)["transformers"] == "0.0.1"
    text = version_text(tmp_path)
    assert f"transformers {md.version('transformers')} (the lock pins 0.0.1)" in text
    assert "lm-eval" in text and text.count("(locked)") == 2  # torch's CUDA/CPU label is not a difference
    assert "(git" not in text.splitlines()[0]  # not a checkout


def test_outside_a_lock_it_says_so(tmp_path):
    assert "(no lock file: not a checkout)" in version_text(tmp_path)


def test_git_commit_marks_a_dirty_checkout(tmp_path):
    assert git_commit(tmp_path) is None
    run = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    (tmp_path / "f.txt").write_text("a")
    run("add", "f.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    clean = git_commit(tmp_path)
    assert clean and "+dirty" not in clean
    (tmp_path / "f.txt").write_text("b")
    assert git_commit(tmp_path) == clean + "+dirty"
