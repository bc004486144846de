"""`moesweep sql` takes its query as an argument (one that starts with a `--` comment too), from a file
(--file) or from stdin (-); SQLite's table-valued PRAGMA functions read as their PRAGMAs do, and what
changes the database is still refused."""

from __future__ import annotations

import pytest
from test_readonly import dbfile, master, one_error_line, snapshot  # noqa: F401  (a database with rows)
from typer.testing import CliRunner

from orchestrator.cli import app

runner = CliRunner()


def sql(path, *args: str, input: str | None = None):
    return runner.invoke(app, ["sql", *args, "--db", f"sqlite:///{path}", "-f", "csv"], input=input)


def test_a_query_that_starts_with_a_comment(dbfile):  # noqa: F811
    r = sql(dbfile, "-- how many sweeps\nSELECT COUNT(*) AS n FROM sweeps WHERE name = 'mine'")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["n", "1"]
    r = sql(dbfile, "--no newline, then\n/* and a block */ SELECT 2 AS n")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["n", "2"], r.output


def test_a_comment_before_a_write_does_not_hide_it(dbfile):  # noqa: F811
    before = snapshot(dbfile)
    line = one_error_line(sql(dbfile, "-- tidy up\nDELETE FROM metrics"))
    assert "refused" in line and "read-only" in line, line
    assert snapshot(dbfile) == before


def test_the_query_from_a_file_or_stdin(dbfile, tmp_path):  # noqa: F811
    q = tmp_path / "q.sql"
    q.write_text("-- the sweeps I launched\nSELECT name FROM sweeps\nWHERE kind = 'own';\n")
    r = sql(dbfile, "--file", str(q))
    assert r.exit_code == 0 and r.stdout.splitlines() == ["name", "mine"], r.output
    r = sql(dbfile, "-", input="SELECT COUNT(*) AS n FROM sweeps WHERE name = 'mine'\n")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["n", "1"], r.output


def test_query_input_errors_are_one_line(dbfile, tmp_path):  # noqa: F811
    q = tmp_path / "q.sql"
    q.write_text("SELECT 1")
    assert one_error_line(sql(dbfile, "SELECT 2", "--file", str(q))) == (
        f"error: --file {q} and a query 'SELECT 2': give one of them"
    )
    missing = tmp_path / "nope.sql"
    assert one_error_line(sql(dbfile, "--file", str(missing))) == (
        f"error: --file {missing}: cannot read it: No such file or directory"
    )
    assert "cannot read it: Is a directory" in one_error_line(sql(dbfile, "--file", str(tmp_path)))
    (tmp_path / "bin.sql").write_bytes(b"\xff\xfe\x00SELECT")
    assert "not UTF-8 text" in one_error_line(sql(dbfile, "--file", str(tmp_path / "bin.sql")))
    (tmp_path / "empty.sql").write_text("\n \n")
    assert "is empty" in one_error_line(sql(dbfile, "--file", str(tmp_path / "empty.sql")))
    assert "is empty" in one_error_line(sql(dbfile, "-", input=""))
    assert one_error_line(runner.invoke(app, ["sql", "--db", f"sqlite:///{dbfile}"])).startswith(
        "error: no query: give one"
    )


@pytest.mark.parametrize(
    ("query", "value"),
    [
        ("SELECT name FROM pragma_table_info('jobs') WHERE name = 'key'", "key"),
        ("SELECT name FROM pragma_table_xinfo('jobs') WHERE name = 'key'", "key"),
        ("SELECT COUNT(*) > 0 FROM pragma_index_list('jobs')", "1"),
        (
            "SELECT p.name FROM pragma_index_list('jobs') l, pragma_index_info(l.name) p WHERE p.name = 'key'",
            "key",
        ),
        (
            "SELECT DISTINCT \"table\" FROM pragma_foreign_key_list('metrics') WHERE \"table\" = 'jobs'",
            "jobs",
        ),
        (
            "SELECT m.name FROM sqlite_master m, pragma_table_info(m.name) c WHERE c.name = 'config_key' LIMIT 1",
            "configurations",
        ),
        ("SELECT journal_mode FROM pragma_journal_mode", "wal"),
        ("SELECT value FROM json_each('[1, 2]') WHERE value = 2", "2"),
    ],
)
def test_table_valued_pragma_functions_read(dbfile, query, value):  # noqa: F811
    before = snapshot(dbfile)
    r = sql(dbfile, query)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[1:] == [value], r.stdout
    assert snapshot(dbfile) == before


@pytest.mark.parametrize(
    "query",
    [
        "UPDATE sqlite_master SET sql = '' WHERE name = 'jobs'",
        "PRAGMA writable_schema=ON",
        "SELECT * FROM pragma_table_info('jobs'); DELETE FROM metrics",
        "SELECT * FROM pragma_writable_schema",
    ],
)
def test_what_changes_the_schema_is_still_refused(dbfile, query):  # noqa: F811
    before = snapshot(dbfile)
    one_error_line(sql(dbfile, query))
    assert snapshot(dbfile) == before
