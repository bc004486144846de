"""Every database problem is one plain line on stderr, exit 2, and creates no file or folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "tests" / "sweeps" / "micro.yaml"
PG_DOWN = "postgresql+psycopg://u:secret@127.0.0.1:1/x"  # nothing listens on port 1


def commands(url: str, read_only_only: bool = False) -> list[list[str]]:
    read = [["sql", "SELECT 1", "--db", url], ["status", "x", "--db", url]]
    write = [
        ["migrate", "--db", url],
        ["import-paper", "--db", url],
        ["launch", str(SWEEP), "--db", url, "--executor", "serial"],
    ]
    return read if read_only_only else read + write


def error_line(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (args, result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    return tmp_path


def test_malformed_url(cwd):
    for args in commands("nonsense"):
        line = error_line(args)
        assert line == (
            "error: --db: 'nonsense' is not a database URL; expected sqlite:///PATH or "
            "postgresql+psycopg://USER@HOST/DB"
        ), line
    assert os.listdir(cwd) == []


def test_malformed_url_from_the_environment_is_named(cwd, monkeypatch):
    monkeypatch.setenv("MOESWEEP_DB", "nonsense")
    assert error_line(["sql", "SELECT 1"]).startswith("error: $MOESWEEP_DB: 'nonsense' is not a database URL")
    assert os.listdir(cwd) == []


def test_unknown_database_kind_or_missing_driver(cwd, monkeypatch):
    for args in commands("nosuchdb://u@host/x"):
        assert (
            "unknown or unsupported database kind or driver 'nosuchdb'; expected sqlite:///PATH"
            in error_line(args)
        )
    for url in ("postgresql+nosuchdriver://u:secret@h/x", "sqlite+aiosqlite:///x.db"):
        line = error_line(["migrate", "--db", url])
        assert "unknown or unsupported database kind or driver" in line and "secret" not in line
    monkeypatch.setitem(sys.modules, "MySQLdb", None)
    for args in commands("mysql://u@host/x")[2:]:
        assert error_line(args) == (
            "error: mysql://u@host/x: the mysql driver MySQLdb is not installed (pip install MySQLdb)"
        )
    for args in commands("mysql://u@host/x", read_only_only=True):
        assert "read-only access needs SQLite or PostgreSQL through psycopg" in error_line(args)
    assert os.listdir(cwd) == []


def test_reading_a_missing_database_creates_nothing(cwd):
    for url in (f"sqlite:///{cwd}/nonexistent/dir/x.db", "sqlite:///mistyped.db"):
        for args in commands(url, read_only_only=True):
            line = error_line(args)
            assert line.startswith("error: no database at ") and "(moesweep launch" in line, line
    assert os.listdir(cwd) == []
    # the default database, when there is none yet
    assert error_line(["sql", "SELECT 1"]) == (
        f"error: no database at {cwd}/home/moesweep.db (moesweep launch or moesweep migrate creates one)"
    )
    assert os.listdir(cwd) == []


def test_unreachable_postgres(cwd):
    import psycopg  # noqa: F401  (the dev extra installs it; without it this test fails, it does not skip)

    for args in commands(PG_DOWN):
        line = error_line(args)
        assert line.startswith("error: cannot connect to postgresql+psycopg://u:***@127.0.0.1:1/x: "), line
        assert "refused" in line.lower() and "secret" not in line
    assert os.listdir(cwd) == []


def test_missing_postgres_driver(cwd, monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # `import psycopg` now fails as if not installed
    for args in commands(PG_DOWN):
        line = error_line(args)
        assert "PostgreSQL driver psycopg is not installed: pip install 'moesweep[postgres]'" in line, line
        assert "secret" not in line
    assert os.listdir(cwd) == []


def test_read_only_postgres_needs_psycopg(cwd):
    line = error_line(["sql", "SELECT 1", "--db", "postgresql+pg8000://u@127.0.0.1:1/x"])
    assert "read-only access needs SQLite or PostgreSQL through psycopg" in line
    assert "postgresql+psycopg://" in line


def test_a_file_that_is_not_a_database(cwd):
    readme = cwd / "README.md"
    readme.write_text("# not a database\n" * 100)
    before = readme.read_bytes()
    for args in commands(f"sqlite:///{readme}"):
        assert error_line(args) == f"error: {readme} is not a SQLite database", args
    assert readme.read_bytes() == before and os.listdir(cwd) == ["README.md"]


def test_a_folder_is_not_a_database(cwd):
    (cwd / "d").mkdir()
    for args in commands(f"sqlite:///{cwd / 'd'}"):
        assert error_line(args) == f"error: {cwd / 'd'} is a folder, not a database file"
    assert os.listdir(cwd) == ["d"] and os.listdir(cwd / "d") == []


def test_in_memory_database_cannot_be_read(cwd):
    line = error_line(["sql", "SELECT 1", "--db", "sqlite://"])
    assert "in-memory database cannot be opened read-only" in line


def test_database_under_a_file_cannot_be_created(cwd):
    (cwd / "afile").write_text("x")
    for args in commands(f"sqlite:///{cwd}/afile/x.db")[2:]:
        line = error_line(args)
        assert line == f"error: {cwd}/afile/x.db: cannot create it: {cwd}/afile is a file, not a folder"
    assert os.listdir(cwd) == ["afile"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc (a folder nobody may write)")
def test_database_in_a_folder_nobody_may_write(cwd):
    path = Path(f"/proc/moesweep-test-{os.getpid()}.db")
    for args in commands(f"sqlite:///{path}")[2:]:
        line = error_line(args)
        assert line == (
            f"error: {path}: cannot open or create the database file (does its folder exist, may "
            "you write it?)"
        ), line
    assert not path.exists()


def test_database_in_a_read_only_folder(cwd):
    """A folder the user may not write. Root may write any folder, so as root the commands run without
    the capabilities that let root override file permissions (setpriv, from util-linux)."""
    folder = cwd / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail(
                "as root this test needs setpriv (util-linux) to run moesweep without "
                "CAP_DAC_OVERRIDE, the capability that lets root write a read-only folder"
            )
        prefix = [
            setpriv,
            "--inh-caps=-dac_override,-dac_read_search",
            "--bounding-set=-dac_override,-dac_read_search",
            "--",
        ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MOESWEEP_HOME=str(cwd / "home"))
    env.pop("MOESWEEP_DB", None)
    try:
        for args in commands(f"sqlite:///{folder}/x.db")[2:]:
            proc = subprocess.run(
                [*prefix, sys.executable, "-m", "orchestrator.cli", *args],
                capture_output=True,
                text=True,
                env=env,
                cwd=cwd,
                timeout=300,
            )
            assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
            assert proc.stderr == (
                f"error: {folder}/x.db: cannot open or create the database file (does its "
                "folder exist, may you write it?)\n"
            ), (args, proc.stderr[-2000:])
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o755)


def test_errors_do_not_wrap_in_a_pipe(tmp_path):
    """The CLI as users run it: stderr is a pipe, and a long message stays on one line."""
    deep = tmp_path / ("a-long-folder-name-" * 6) / "x.db"
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="40")
    env.pop("MOESWEEP_DB", None)
    cmd = [sys.executable, "-m", "orchestrator.cli", "sql", "SELECT 1", "--db", f"sqlite:///{deep}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == f"error: no database at {deep} (moesweep launch or moesweep migrate creates one)\n"
    assert len(proc.stderr) > 120
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("how", ["--db", "MOESWEEP_DB"])
def test_a_dry_run_plans_for_a_database_that_does_not_exist_yet_and_creates_nothing(
    tmp_path, monkeypatch, how
):
    path = tmp_path / "later" / "new.db"
    args = ["launch", str(SWEEP), "--dry-run"]
    if how == "--db":
        args += ["--db", f"sqlite:///{path}"]
    else:
        monkeypatch.setenv("MOESWEEP_DB", f"sqlite:///{path}")
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    assert "convert" in result.stdout and "ppl_pre" in result.stdout  # the plan
    assert result.stderr.strip() == f"no database at {path} yet: planned as for a new one (nothing created)"
    assert not path.exists() and not path.parent.exists()
