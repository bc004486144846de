"""`moesweep sql` and `status` open the database read-only: every write is refused in one line, exit 2,
and the database is left exactly as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3

import pytest
from typer.testing import CliRunner

import db.store as store_mod
from analysis.load import load_frames
from analysis.reference import reference_sweeps
from db.store import Store, StoreError
from orchestrator.cli import app

runner = CliRunner()
SIDE_FILES = ("-wal", "-shm")  # SQLite's shared-memory files beside a WAL database, not data


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A database with rows in every table that `sql` could damage (jobs, metrics, configurations)."""
    path = tmp_path_factory.mktemp("master") / "m.db"
    s = Store(f"sqlite:///{path}")
    s.import_reference(reference_sweeps())
    sid = s.upsert_sweep("mine", spec_yaml="name: mine")
    ids = s.register_jobs(sid, [{"key": f"j{i}", "stage": "ppl_pre", "params": {"i": i}} for i in range(3)])
    cids = s.upsert_configs(
        sid,
        [
            {
                "config_key": f"c{i}",
                "model": "m",
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 4,
                "top_k": 2,
            }
            for i in range(3)
        ],
    )
    s.link([(cids[f"c{i}"], "ppl_pre", ids[f"j{i}"]) for i in range(3)])
    assert s.claim("j0", "me")
    s.finish("j0", "me", {"metrics": [{"name": "ppl", "stage": "pre", "value": 12.5}]}, 1.0)
    s.engine.dispose()
    return path


@pytest.fixture
def dbfile(master, tmp_path):
    path = tmp_path / "db" / "copy.db"
    path.parent.mkdir()
    shutil.copy(master, path)
    return path


def snapshot(path) -> dict:
    """Bytes of the database file, the other files beside it, and every table's and view's row count."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    files = sorted(f for f in os.listdir(path.parent) if not f.endswith(SIDE_FILES))
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        objects = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY type, name").fetchall()
        counts = {
            name: conn.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0]
            for kind, name, _ in objects
            if kind in ("table", "view")
        }
        version = conn.execute("SELECT version_num FROM moesweep_alembic_version").fetchall()
        pragmas = {p: conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("journal_mode", "user_version")}
    finally:
        conn.close()
    return {
        "sha": digest,
        "files": files,
        "objects": objects,
        "counts": counts,
        "version": version,
        "pragmas": pragmas,
    }


def sql(path, query, *extra):
    return runner.invoke(app, ["sql", query, "--db", f"sqlite:///{path}", *extra])


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    return lines[0]


REFUSED = [
    "DELETE FROM metrics",
    "UPDATE metrics SET value=1.0",
    "INSERT INTO sweeps (name, kind, source) VALUES ('evil', 'own', 'x')",
    "DROP TABLE jobs",
    "DROP VIEW results",
    "DROP TABLE moesweep_alembic_version",
    "CREATE TABLE evil (x INTEGER)",
    "CREATE TRIGGER evil AFTER INSERT ON jobs BEGIN DELETE FROM metrics; END",
    "PRAGMA writable_schema=1",
    "PRAGMA journal_mode=DELETE",
    "PRAGMA query_only=OFF",
    "VACUUM",
    "REINDEX",
    "ANALYZE",
    "ALTER TABLE jobs RENAME TO evil",
    "CREATE TEMP TABLE evil (x INTEGER)",
    "SELECT 1; DELETE FROM metrics",
    "SELECT load_extension('evil')",
]


@pytest.mark.parametrize("query", REFUSED)
def test_sql_refuses_every_change_and_changes_nothing(dbfile, query):
    before = snapshot(dbfile)
    line = one_error_line(sql(dbfile, query))
    assert (
        ("refused" in line and "read-only" in line)
        or "one statement at a time" in line
        or "not authorized" in line
    ), line
    assert snapshot(dbfile) == before


def test_attach_is_refused_and_creates_no_file(dbfile, tmp_path):
    target = tmp_path / "x" / "new.db"
    target.parent.mkdir()
    before = snapshot(dbfile)
    line = one_error_line(sql(dbfile, f"ATTACH DATABASE '{target}' AS x"))
    assert "refused" in line and "ATTACH" in line
    assert not target.exists() and os.listdir(target.parent) == []
    assert snapshot(dbfile) == before


def test_a_refused_write_never_reaches_the_database(dbfile):
    """The authorizer is one layer: with it removed, mode=ro and query_only still refuse the write."""
    s = Store(f"sqlite:///{dbfile}", read_only=True)
    with s.engine.connect() as c:
        raw = c.connection.dbapi_connection
        raw.set_authorizer(None)
        with pytest.raises(sqlite3.OperationalError, match="readonly|query_only"):
            raw.execute("DELETE FROM metrics")
        raw.execute("PRAGMA query_only=OFF")
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            raw.execute("DELETE FROM metrics")
    s.engine.dispose()
    assert snapshot(dbfile)["counts"]["metrics"] > 0


def test_selects_with_queries_and_reporting_pragmas_still_work(dbfile):
    before = snapshot(dbfile)
    r = sql(dbfile, "SELECT COUNT(*) AS n FROM metrics", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == [{"n": before["counts"]["metrics"]}]
    r = sql(dbfile, "WITH s AS (SELECT name FROM sweeps) SELECT name FROM s WHERE name = 'mine'", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["name", "mine"]
    r = sql(
        dbfile,
        "SELECT c.config_key, ppl_pre FROM results r JOIN configurations c ON c.id = r.config_id "
        "WHERE c.config_key = 'c0'",
    )
    assert r.exit_code == 0 and "c0" in r.stdout and "12.5" in r.stdout
    r = sql(
        dbfile,
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 3) "
        "SELECT SUM(i) AS s FROM n",
        "-f",
        "csv",
    )
    assert r.exit_code == 0 and r.stdout.splitlines() == ["s", "6"]
    r = sql(dbfile, "PRAGMA table_info(jobs)", "-f", "csv")
    assert r.exit_code == 0 and ",key," in r.stdout
    r = sql(dbfile, "PRAGMA journal_mode", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["journal_mode", "wal"]
    assert snapshot(dbfile) == before


def test_sql_errors_are_one_line(dbfile):
    assert one_error_line(sql(dbfile, "SELECT * FROM no_such_table")) == "error: no such table: no_such_table"
    assert "syntax error" in one_error_line(sql(dbfile, "SELEC 1"))
    assert "--format 'xml': allowed: table, csv, json" in one_error_line(sql(dbfile, "SELECT 1", "-f", "xml"))
    assert one_error_line(sql(dbfile, "SELECT * FROM jobs WHERE key = :k")) == (
        "error: A value is required for bind parameter 'k' (write the value into the query: a :name is a "
        "parameter)"
    )


def test_status_reads_only(dbfile):
    before = snapshot(dbfile)
    r = runner.invoke(app, ["status", "mine", "--db", f"sqlite:///{dbfile}"])
    assert r.exit_code == 0, r.output
    assert "ppl_pre" in r.stdout and "configurations: 3" in r.stdout
    line = one_error_line(runner.invoke(app, ["status", "nope", "--db", f"sqlite:///{dbfile}"]))
    assert "no sweep 'nope'" in line
    assert snapshot(dbfile) == before


def test_read_only_store_serves_the_analysis_loader(dbfile):
    before = snapshot(dbfile)
    s = Store(f"sqlite:///{dbfile}", read_only=True)
    frames = load_frames(s.engine, ["mine"])
    assert len(frames.results) == 3 and frames.results["ppl_pre"].notna().sum() == 1
    assert s.sweep_id("mine") is not None and s.job_counts(s.sweep_id("mine"))[("ppl_pre", "succeeded")] == 1
    with pytest.raises(StoreError, match="refused"):
        s.query("DELETE FROM metrics")
    with pytest.raises(StoreError, match="read-only"):
        s.migrate()
    s.engine.dispose()
    assert snapshot(dbfile) == before


def test_read_only_store_never_creates_a_database(tmp_path):
    missing = tmp_path / "no" / "such" / "x.db"
    with pytest.raises(StoreError, match=r"no database at .*x\.db \(moesweep launch"):
        Store(f"sqlite:///{missing}", read_only=True)
    assert not (tmp_path / "no").exists()
    for url in ("sqlite://", "sqlite:///:memory:"):
        with pytest.raises(StoreError, match="in-memory"):
            Store(url, read_only=True)


def test_schema_revision_is_checked(dbfile, monkeypatch):
    url = f"sqlite:///{dbfile}"
    current = store_mod.head_revision()
    monkeypatch.setattr(store_mod, "head_revision", lambda: "9000")  # as if this moesweep were newer
    line = one_error_line(runner.invoke(app, ["sql", "SELECT 1", "--db", url]))
    assert (
        f"revision {current}, this moesweep needs 9000" in line and f"moesweep migrate --db '{url}'" in line
    )
    monkeypatch.undo()

    conn = sqlite3.connect(dbfile)
    conn.execute("UPDATE moesweep_alembic_version SET version_num = '9999'")
    conn.commit()
    conn.close()
    line = one_error_line(runner.invoke(app, ["sql", "SELECT 1", "--db", url]))
    assert "revision '9999', unknown to this moesweep" in line
    line = one_error_line(runner.invoke(app, ["migrate", "--db", url]))
    assert line.startswith("error: cannot migrate") and "9999" in line


def test_a_database_without_the_schema_is_named_and_migrate_adds_it(tmp_path):
    path = tmp_path / "foreign.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE other (x INTEGER)")
    conn.commit()
    conn.close()
    url = f"sqlite:///{path}"
    line = one_error_line(runner.invoke(app, ["status", "x", "--db", url]))
    assert "is not a moesweep database" in line and f"moesweep migrate --db '{url}'" in line
    r = runner.invoke(app, ["migrate", "--db", url])
    assert r.exit_code == 0, r.output
    assert f"schema at revision {store_mod.head_revision()}" in r.stdout
    r = runner.invoke(app, ["sql", "SELECT COUNT(*) AS n FROM other", "--db", url, "-f", "csv"])
    assert r.exit_code == 0 and r.stdout.splitlines() == ["n", "0"]


# ---- PostgreSQL: a database of its own on the tests' server (a throwaway cluster, or MOESWEEP_TEST_PG_URL's;
# see tests/throwaway_pg.py), with the schema and the paper's reference sweeps; nothing may change it
@pytest.fixture(scope="module")
def pg_url(pg_database):
    url = pg_database("readonly")
    s = Store(url)
    s.import_reference(reference_sweeps())
    s.engine.dispose()
    return url


def pg_counts(url) -> dict:
    s = Store(url, read_only=True)
    out = {
        t: s.query(f"SELECT COUNT(*) FROM {t}")[1][0][0]
        for t in ("sweeps", "configurations", "metrics", "moesweep_alembic_version")
    }
    out["views"] = s.query("SELECT COUNT(*) FROM information_schema.views WHERE table_name = 'results'")[1]
    s.engine.dispose()
    return out


@pytest.mark.parametrize(
    "query",
    [
        "DELETE FROM metrics",
        "UPDATE metrics SET value=1.0",
        "DROP TABLE jobs",
        "DROP VIEW results",
        "DROP TABLE moesweep_alembic_version",
        "CREATE TABLE evil (x INTEGER)",
        "SELECT 1; DELETE FROM metrics",
        "COMMIT; SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE; DELETE FROM metrics",
        "SET TRANSACTION READ WRITE",
        "SELECT set_config('transaction_read_only', 'off', true)",
        "VACUUM",
    ],
)
def test_postgres_sql_is_read_only(pg_url, query):
    before = pg_counts(pg_url)
    one_error_line(runner.invoke(app, ["sql", query, "--db", pg_url]))
    assert pg_counts(pg_url) == before


def test_postgres_session_cannot_be_switched_to_read_write(pg_url):
    """Even a session whose default was flipped (and committed) starts every transaction read-only."""
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    s = Store(pg_url, read_only=True)
    with s.engine.connect() as c:
        raw = c.connection.dbapi_connection
        raw.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE")
        raw.commit()
        with pytest.raises(DBAPIError, match="read-only transaction"):
            c.execute(text("DELETE FROM metrics"))
    assert s.query("SELECT COUNT(*) FROM metrics")[1][0][0] > 0
    frames = load_frames(s.engine, ["paper:architectures"])
    assert len(frames.results) > 0
    s.engine.dispose()
