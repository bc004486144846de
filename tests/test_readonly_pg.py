"""A PostgreSQL reader (`moesweep sql`, the dashboard) reached through a superuser's URL can reach nothing
outside the database: `moesweep sql` refuses every statement but a query and every function that reads or
writes the server's files, and the session itself reads as the role `moesweep_reader`, so the server
refuses them too (COPY to a file or a program, pg_read_file, lo_import, LOAD, CHECKPOINT). The server's
files are checked: nothing is written, no program runs."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from typer.testing import CliRunner

from analysis.reference import reference_sweeps
from db.store import Store, StoreError
from orchestrator.cli import app

runner = CliRunner()
READER_ROLE = "moesweep_reader"  # the role a privileged login reads as (README)


@pytest.fixture(scope="module")
def pg_url(pg_database):
    url = pg_database("reader_role")
    s = Store(url)
    s.import_reference(reference_sweeps())
    s.engine.dispose()
    return url


@pytest.fixture
def drop():
    """A folder the server's user may write (pytest's own folders are private to this user)."""
    d = Path(tempfile.mkdtemp(prefix="moesweep-drop-", dir="/tmp" if os.path.isdir("/tmp") else None))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def sql(url: str, query: str, *extra: str):
    return runner.invoke(app, ["sql", query, "--db", url, *extra])


def one_error_line(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def server_files_attacks(d: Path) -> list[str]:
    """Statements that reach the server's files or processes; those that write, write into `d`."""
    return [
        f"COPY (SELECT 1) TO '{d}/copied'",
        f"COPY sweeps TO PROGRAM 'touch {d}/ran'",
        f"-- a note first\nCOPY (SELECT 1) TO PROGRAM 'touch {d}/ran2'",
        "SELECT pg_read_file('/etc/hostname')",
        "SELECT pg_ls_dir('/')",
        "SELECT lo_import('/etc/hostname')",
        "LOAD 'plpgsql'",
        "CHECKPOINT",
    ]


def test_the_folder_is_one_the_server_writes(pg_url, drop):
    """The control: through the writer's (superuser) connection the same COPY does write there, so a reader's
    refusal below is the reader's, not a folder the server cannot reach."""
    s = Store(pg_url)
    s.query(f"COPY (SELECT 1) TO '{drop}/control'")
    s.engine.dispose()
    assert (drop / "control").exists()


def test_sql_refuses_what_reaches_the_servers_files(pg_url, drop):
    for query in server_files_attacks(drop):
        line = one_error_line(sql(pg_url, query))
        assert "refused" in line and "nothing was run" in line, (query, line)
    assert os.listdir(drop) == []


def test_sql_refuses_analyze_and_it_analyzes_nothing(pg_url):
    assert "refused 'ANALYZE'" in one_error_line(sql(pg_url, "ANALYZE"))
    assert "refused" in one_error_line(sql(pg_url, "ANALYZE sweeps"))
    r = sql(
        pg_url, "SELECT COUNT(*) AS n FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL", "-f", "csv"
    )
    assert r.exit_code == 0 and r.stdout.splitlines() == ["n", "0"], r.output


@pytest.mark.parametrize(
    "query",
    [
        "SELECT set_config('role', 'moesweep', false)",
        "SELECT pg_catalog.set_config('session_authorization', 'moesweep', false)",
        "RESET ROLE",
        "SET ROLE NONE",
        "SELECT query_to_xml('SELECT 1', true, false, '')",
        'SELECT * FROM U&"sweeps"',
        "SELECT pg_terminate_backend(1)",
        "EXECUTE anything",
        "DO $$ BEGIN NULL; END $$",
    ],
)
def test_sql_refuses_what_would_change_the_role_or_run_sql_of_its_own(pg_url, query):
    line = one_error_line(sql(pg_url, query))
    assert "refused" in line and "nothing was run" in line, line


def test_the_server_refuses_them_too(pg_url, drop):
    """Past `moesweep sql`'s checks, straight through the reader's session: the server refuses each."""
    s = Store(pg_url, read_only=True)
    for query in server_files_attacks(drop):
        with (
            s.engine.connect() as c,
            pytest.raises(DBAPIError, match="superuser|permission denied|not allowed"),
        ):
            c.exec_driver_sql(query)
    with s.engine.connect() as c:  # ANALYZE skips what the reader does not own, with a warning
        c.exec_driver_sql("ANALYZE")
        c.rollback()
        assert c.scalar(text("SELECT COUNT(*) FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL")) == 0
    s.engine.dispose()
    assert os.listdir(drop) == []


def test_a_superusers_reader_reads_as_the_reader_role(pg_url):
    r = sql(pg_url, "SELECT current_user AS who, (SELECT COUNT(*) FROM results) > 0 AS rows", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["who,rows", f"{READER_ROLE},True"], r.output
    r = sql(pg_url, "SHOW is_superuser", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["is_superuser", "off"], r.output
    r = sql(pg_url, "-- which sweeps\nSELECT COUNT(*) AS n FROM sweeps WHERE kind = 'reference'", "-f", "csv")
    assert r.exit_code == 0 and int(r.stdout.splitlines()[1]) > 0, r.output


@pytest.fixture
def login(pg_url):
    """`login(name, *grants)`: the URL of a new login role on the server, dropped afterwards."""
    admin = Store(pg_url)
    made: list[str] = []

    def make(label: str, *grants: str) -> str:
        name = f"moesweep_test_{os.getpid()}_{label}"
        with admin.engine.begin() as c:
            c.exec_driver_sql(f"CREATE ROLE {name} LOGIN PASSWORD 'pw'")
            c.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {name}")
            for g in grants:
                c.exec_driver_sql(f"GRANT {g} TO {name}")
        made.append(name)
        return make_url(pg_url).set(username=name, password="pw").render_as_string(hide_password=False)

    yield make
    with admin.engine.begin() as c:
        for name in made:
            c.exec_driver_sql(f"DROP OWNED BY {name}")
            c.exec_driver_sql(f"DROP ROLE {name}")
    admin.engine.dispose()


def test_a_plain_login_reads_as_itself(pg_url, login):
    url = login("plain")
    r = sql(url, "SELECT current_user AS who", "-f", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == ["who", make_url(url).username], r.output


def test_a_privileged_login_that_cannot_switch_is_refused_in_one_line(pg_url, login):
    url = login("files", "pg_read_server_files")
    line = one_error_line(sql(url, "SELECT 1"))
    assert "may read or write the server's files" in line and "CREATE ROLE r LOGIN" in line, line
    assert "pw" not in line.replace("pwd", "")


def test_a_reader_role_that_was_given_more_is_refused(pg_url):
    admin = Store(pg_url)
    Store(pg_url, read_only=True).engine.dispose()  # the role exists
    with admin.engine.begin() as c:
        c.exec_driver_sql(f"GRANT pg_write_server_files TO {READER_ROLE}")
    try:
        with pytest.raises(
            StoreError, match=f"the role {READER_ROLE} that moesweep reads through may itself"
        ):
            Store(pg_url, read_only=True)
    finally:
        with admin.engine.begin() as c:
            c.exec_driver_sql(f"REVOKE pg_write_server_files FROM {READER_ROLE}")
        admin.engine.dispose()
