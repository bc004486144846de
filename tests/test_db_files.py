"""The SQLite file a command is given: a URL that names no file, a path that cannot be one, a file that is
damaged or may not be written, a folder that may not be written. Each is one line and exit 2, before
anything is created or run; readers read a database in a folder they may not write and leave no file
behind where they may."""

from __future__ import annotations

import gc
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from test_readonly import dbfile, master  # noqa: F401  (a database with rows in every table)
from test_readonly import snapshot as snapshot_with_side_files
from typer.testing import CliRunner

import db.store as store_mod
from db.store import Store, StoreError
from orchestrator.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "tests" / "sweeps" / "micro.yaml"


def error_line(args: list[str]) -> str:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (args, result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, result.stderr)
    return lines[0]


def commands(url: str) -> list[list[str]]:
    """Every command that opens the database: readers, then writers."""
    return [
        ["sql", "SELECT 1", "--db", url],
        ["status", "x", "--db", url],
        ["sweeps", "--db", url],
        ["report", "x", "--db", url],
        ["verify", "--db", url],
        ["migrate", "--db", url],
        ["import-paper", "--db", url],
        ["launch", str(SWEEP), "--db", url, "--executor", "serial"],
    ]


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOESWEEP_DB", raising=False)
    monkeypatch.setenv("MOESWEEP_HOME", str(tmp_path / "home"))
    return tmp_path


def files(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def snapshot(path: Path) -> dict:
    """test_readonly's snapshot, without the -shm and -wal files its mode=ro connection leaves: a plain
    connection, the last to close, removes them."""
    out = snapshot_with_side_files(path)
    conn = sqlite3.connect(path)
    conn.execute("SELECT 1 FROM sqlite_master").fetchall()
    conn.close()
    return out


# ---- URLs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:"])
def test_writers_refuse_an_in_memory_database(cwd, url):
    for args in (["import-paper", "--db", url], ["launch", str(SWEEP), "--db", url, "--executor", "serial"]):
        line = error_line(args)
        assert line == (
            f"error: --db: {url!r}: an in-memory database keeps nothing once the command ends (a launch "
            "would run and leave no results); give a file, sqlite:///PATH"
        ), line


def test_a_sqlite_url_with_two_slashes_says_three(cwd):
    for args in commands("sqlite://results.db"):
        line = error_line(args)
        assert "a SQLite URL names no host; a path follows three slashes, sqlite:///results.db" in line, line
    assert "sqlite:///runs/results.db" in error_line(["sql", "SELECT 1", "--db", "sqlite://runs/results.db"])
    assert not (cwd / "results.db").exists() and not (cwd / "runs").exists()


def test_a_nul_in_the_path(cwd):
    for args in commands("sqlite:///x%00y.db"):
        assert error_line(args) == (
            "error: --db: 'sqlite:///x%00y.db': the path holds a NUL character (%00), which no file name may hold"
        ), args
    assert files(cwd) == []


# ---- verify: it checks what is there ----------------------------------------------------------------------
def test_verify_creates_no_database_at_a_mistyped_path(cwd):
    typo = cwd / "typo" / "moesweep.db"
    line = error_line(["verify", "--db", f"sqlite:///{typo}"])
    assert line == f"error: no database at {typo} (moesweep launch or moesweep migrate creates one)"
    line = error_line(["verify", "some-sweep", "--db", f"sqlite:///{typo}"])
    assert "no database at" in line
    assert files(cwd) == []


def test_verify_migrates_nothing(dbfile, monkeypatch):  # noqa: F811
    before = snapshot(dbfile)
    current = store_mod.head_revision()
    monkeypatch.setattr(store_mod, "head_revision", lambda: "9000")  # as if this moesweep were newer
    line = error_line(["verify", "--db", f"sqlite:///{dbfile}"])
    assert f"is at schema revision {current}, this moesweep needs 9000" in line, line
    assert snapshot(dbfile) == before


# ---- paths that cannot be a database ------------------------------------------------------------------
def test_a_file_name_too_long_for_the_file_system(cwd):
    path = cwd / ("x" * 300 + ".db")
    for args in commands(f"sqlite:///{path}"):
        line = error_line(args)
        assert line == (
            f"error: {path}: the path is too long for the file system (its longest name has 303 bytes; "
            "allowed: at most 255 bytes a name, 4096 in all); choose a shorter one"
        ), (args, line)
    assert files(cwd) == []


def test_a_fifo_is_refused_before_it_is_opened(cwd):
    """A reader opening a FIFO waits for a writer that never comes: each command runs in a process of its
    own, and one that hangs fails the test."""
    fifo = cwd / "pipe.db"
    os.mkfifo(fifo)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args in commands(f"sqlite:///{fifo}")[:2] + commands(f"sqlite:///{fifo}")[5:7]:
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=cwd,
            timeout=120,
        )
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr == (
            f"error: {fifo} is a FIFO (named pipe), not a database file; a SQLite database is a regular file\n"
        ), (args, proc.stderr[-2000:])
    assert files(cwd) == ["pipe.db"]


# ---- a damaged file ------------------------------------------------------------------------------------
def damage(path: Path) -> None:
    """Garbage over the first page of every table and index but the schema revision's: the file opens and
    its revision reads, the rest does not."""
    conn = sqlite3.connect(path)
    page = conn.execute("PRAGMA page_size").fetchone()[0]
    roots = [
        r
        for (r,) in conn.execute(
            "SELECT rootpage FROM sqlite_master WHERE rootpage > 0 AND tbl_name != 'moesweep_alembic_version'"
        )
    ]
    conn.close()
    assert not Path(f"{path}-wal").exists() and len(roots) > 10
    with open(path, "r+b") as f:
        for r in roots:
            f.seek((r - 1) * page)
            f.write(bytes((i * 7 + 3) % 256 for i in range(page)))


def test_a_damaged_database_is_named_in_one_line(dbfile, cwd):  # noqa: F811
    damage(dbfile)
    url = f"sqlite:///{dbfile}"
    want = f"error: {dbfile} is a damaged SQLite database (database disk image is malformed)"
    for args in (
        ["sql", "SELECT * FROM sweeps", "--db", url],
        ["status", "mine", "--db", url],
        ["verify", "--db", url],
        ["import-paper", "--db", url],
        ["launch", str(SWEEP), "--db", url, "--executor", "serial"],
    ):
        line = error_line(args)
        assert line.startswith(want) and "restore it from a backup" in line, (args, line)


# ---- folders and files this process may not write ------------------------------------------------------
SETPRIV = ["--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search", "--"]


def run_unprivileged(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """The CLI in a process of its own; as root, without the capabilities that let root write any file
    (setpriv, from util-linux), so that file permissions hold for it as for any user."""
    prefix = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail(
                "as root this test needs setpriv (util-linux) to run moesweep without CAP_DAC_OVERRIDE"
            )
        prefix = [setpriv, *SETPRIV]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MOESWEEP_HOME=str(cwd / "home"))
    env.pop("MOESWEEP_DB", None)
    return subprocess.run(
        [*prefix, sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


@pytest.fixture
def ro_folder(dbfile):  # noqa: F811
    """The database in a folder nobody may write."""
    dbfile.parent.chmod(0o555)
    yield dbfile
    dbfile.parent.chmod(0o755)


def test_a_reader_reads_a_database_in_a_folder_it_may_not_write(ro_folder, cwd):
    before = snapshot(ro_folder)
    listed = files(ro_folder.parent)
    for query in ("SELECT COUNT(*) AS n FROM configurations", "SELECT name FROM sweeps WHERE name = 'mine'"):
        proc = run_unprivileged(["sql", query, "--db", f"sqlite:///{ro_folder}", "-f", "csv"], cwd)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.splitlines()[1] in (str(before["counts"]["configurations"]), "mine"), proc.stdout
    assert files(ro_folder.parent) == listed
    assert snapshot(ro_folder) == before


def test_writers_refuse_a_database_in_a_folder_they_may_not_write(ro_folder, cwd):
    before = snapshot(ro_folder)
    for args in (
        ["import-paper", "--db", f"sqlite:///{ro_folder}"],
        ["launch", str(SWEEP), "--db", f"sqlite:///{ro_folder}", "--executor", "serial"],
    ):
        proc = run_unprivileged(args, cwd)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert proc.stderr == (
            f"error: {ro_folder}: its folder {ro_folder.parent} is read-only (may you write it?): SQLite "
            "writes the database's -wal and -shm files there; moesweep sql, status, report and serve only "
            "read it\n"
        ), (args, proc.stderr[-2000:])
    assert snapshot(ro_folder) == before


def test_writers_refuse_a_database_file_they_may_not_write(dbfile, cwd):  # noqa: F811
    dbfile.chmod(0o444)
    before = snapshot(dbfile)
    try:
        for args in (
            ["import-paper", "--db", f"sqlite:///{dbfile}"],
            ["launch", str(SWEEP), "--db", f"sqlite:///{dbfile}", "--executor", "serial"],
        ):
            proc = run_unprivileged(args, cwd)
            assert proc.returncode == 2, (args, proc.stderr[-2000:])
            assert proc.stderr == (
                f"error: {dbfile} is read-only (may you write it?): this command writes the database; "
                "moesweep sql, status, report and serve only read it\n"
            ), (args, proc.stderr[-2000:])
    finally:
        dbfile.chmod(0o644)
    assert snapshot(dbfile) == before


def test_a_reader_that_may_not_write_the_folder_opens_the_file_immutable(dbfile, monkeypatch):  # noqa: F811
    """The same in this process (where root may write anything): told the folder is not writable, the
    reader needs no -shm or -wal file, and takes a new connection each time (a launch may start)."""
    monkeypatch.setattr(store_mod, "_writable", lambda path: False)
    before = snapshot(dbfile)
    s = Store(f"sqlite:///{dbfile}", read_only=True)
    with s.engine.connect() as c:
        assert c.exec_driver_sql("SELECT COUNT(*) FROM jobs").scalar() == before["counts"]["jobs"]
        assert files(dbfile.parent) == ["copy.db"]  # nothing beside it while it reads
    assert s.query("SELECT name FROM sweeps WHERE name = 'mine'")[1] == [("mine",)]
    with pytest.raises(StoreError, match="refused"):
        s.query("DELETE FROM metrics")
    s.engine.dispose()
    assert files(dbfile.parent) == ["copy.db"] and snapshot(dbfile) == before


def test_changes_a_read_only_folder_hides_are_said_in_one_line(dbfile, tmp_path, monkeypatch):  # noqa: F811
    """A -wal file with commits but no -shm, in a folder this reader may not write: reading the file as
    immutable would miss the commits, so the reader says so."""
    conn = sqlite3.connect(dbfile)
    conn.execute("PRAGMA wal_autocheckpoint=0")
    conn.execute("UPDATE sweeps SET description = 'changed' WHERE name = 'mine'")
    conn.commit()
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(dbfile, copy / "x.db")
    shutil.copy(f"{dbfile}-wal", copy / "x.db-wal")
    conn.close()
    monkeypatch.setattr(store_mod, "_writable", lambda path: False)
    line = error_line(["sql", "SELECT 1", "--db", f"sqlite:///{copy / 'x.db'}"])
    assert "its x.db-wal holds changes not yet in the database file" in line, line
    assert files(copy) == ["x.db", "x.db-wal"]


def test_readers_leave_no_file_beside_the_database(dbfile):  # noqa: F811
    url = f"sqlite:///{dbfile}"
    assert files(dbfile.parent) == ["copy.db"]
    for args in (["sql", "SELECT COUNT(*) FROM metrics", "--db", url], ["status", "mine", "--db", url]):
        r = runner.invoke(app, args)
        assert r.exit_code == 0, r.output
        gc.collect()
        assert files(dbfile.parent) == ["copy.db"], args
    s = Store(url, read_only=True)
    s.query("SELECT COUNT(*) FROM jobs")
    s.engine.dispose()
    assert files(dbfile.parent) == ["copy.db"]


def test_a_readers_close_leaves_a_running_writers_files(dbfile):  # noqa: F811
    url = f"sqlite:///{dbfile}"
    reader = Store(url, read_only=True)
    reader.query("SELECT COUNT(*) FROM sweeps")
    writer = Store(url)
    writer.upsert_sweep("during")
    reader.engine.dispose()  # the writer has the database open: its files stay
    assert files(dbfile.parent) == ["copy.db", "copy.db-shm", "copy.db-wal"]
    writer.upsert_sweep("after")
    assert Store(url, read_only=True).query("SELECT COUNT(*) FROM sweeps WHERE name IN ('during', 'after')")[
        1
    ] == [(2,)]
    writer.engine.dispose()
    gc.collect()
    assert files(dbfile.parent) == ["copy.db"]
