"""The same work against PostgreSQL as against SQLite: a launch of the fake sweep writes the same results,
`moesweep report` writes the same tables, and the Store's claims, retries and reference import behave the
same. The server: tests/throwaway_pg.py (a throwaway cluster, or MOESWEEP_TEST_PG_URL's)."""

from __future__ import annotations

import socket
from datetime import datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import insert, inspect, text
from typer.testing import CliRunner

from db.models import Base, Configuration, Job, Sweep
from db.store import VERSION_TABLE, Store, head_revision
from orchestrator.cli import app
from tests import test_migrations, test_store
from tests.test_orchestrator import _launch, fake  # noqa: F401  (the fake stage functions fixture)

runner = CliRunner()
RESULTS = (
    'SELECT scoring, grouping, "K", dp_scaling, kind, baseline, ppl_pre, selected_for_distill, avg_acc, '
    "ppl_pre_kind FROM results WHERE sweep = 'fake'"
)  # ppl_pre_kind: the diverged student's 'inf'


def results(store: Store) -> list[tuple]:
    return sorted(store.query(RESULTS)[1], key=repr)


def types(rows: list[tuple]) -> list[list[str]]:
    """Python types of the values (1 == True == 1.0: equal rows may still come back as other types)."""
    return [[type(v).__name__ for v in r] for r in rows]


def job_states(store: Store) -> list[tuple]:
    return sorted(store.query("SELECT stage, status, attempts FROM jobs")[1])


def report_files(url: str, out: Path, *extra: str) -> dict[str, bytes]:
    r = runner.invoke(app, ["report", "fake", "--db", url, "--out", str(out), *extra])
    assert r.exit_code == 0, (r.output, r.exception)
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_fake_launch_writes_the_same_results_and_report_into_postgresql(fake, pg_database, tmp_path):  # noqa: F811
    calls, state = fake
    urls = {"sqlite": state["db"], "postgresql": pg_database("fake_launch")}
    stores = {kind: Store(url) for kind, url in urls.items()}
    rows, jobs = {}, {}
    for kind, store in stores.items():
        state["db"] = urls[kind]  # where the fake distill stage looks for its own live metrics
        state["fail"] = True
        assert _launch(store, state["sweep"]) == 1  # one method fails, the rest goes on
        rows[kind], jobs[kind] = results(store), job_states(store)
    assert rows["postgresql"] == rows["sqlite"] and types(rows["postgresql"]) == types(rows["sqlite"])
    assert jobs["postgresql"] == jobs["sqlite"]
    assert any(r[7] == 1 for r in rows["sqlite"]) and any(r[8] is not None for r in rows["sqlite"])
    assert any(r[9] == "inf" for r in rows["sqlite"])
    assert state["live"] and all(seen == [(4.0,)] for seen in state["live"])  # live metrics, both times

    for kind, store in stores.items():  # retrying the failed method
        state["db"] = urls[kind]
        state["fail"] = False
        assert _launch(store, state["sweep"], retry_failed=True) == 0
        rows[kind], jobs[kind] = results(store), job_states(store)
    assert rows["postgresql"] == rows["sqlite"] and types(rows["postgresql"]) == types(rows["sqlite"])
    assert jobs["postgresql"] == jobs["sqlite"]
    assert {s for _, s, _ in jobs["sqlite"]} == {"succeeded"}

    reports = {kind: report_files(url, tmp_path / f"report-{kind}") for kind, url in urls.items()}
    tex = [name for name in reports["sqlite"] if name.endswith(".tex")]
    assert tex and all(name.startswith("tables/") for name in tex)
    assert sorted(reports["postgresql"]) == sorted(reports["sqlite"])
    for name in reports["sqlite"]:  # tables, index, facts and figures: the same bytes
        assert reports["postgresql"][name] == reports["sqlite"][name], name

    # beside the paper's numbers, imported into each database
    for url in urls.values():
        r = runner.invoke(app, ["import-paper", "--db", url])
        assert r.exit_code == 0, r.output
    reports = {
        kind: report_files(url, tmp_path / f"compare-{kind}", "--compare", "paper")
        for kind, url in urls.items()
    }
    assert sorted(reports["postgresql"]) == sorted(reports["sqlite"])
    for name in reports["sqlite"]:
        assert reports["postgresql"][name] == reports["sqlite"][name], name
    for store in stores.values():
        store.engine.dispose()


# ---- tests/test_store.py's checks, with its store on PostgreSQL -----------------------------------------
STORE_TESTS = [
    "test_claim_is_exclusive_and_finish_is_idempotent",
    "test_non_finite_values_are_explicit",
    "test_concurrent_claims_never_double_run",
    "test_release_gives_back_every_running_job_of_one_owner",
    "test_upsert_sweep_stores_the_selection_rule",
]


@pytest.mark.parametrize("name", STORE_TESTS)
def test_store_on_postgresql(name, pg_database, monkeypatch, tmp_path):
    stores: list[Store] = []

    def make_store(_tmp_path) -> Store:
        stores.append(Store(pg_database(name.removeprefix("test_"))))
        return stores[-1]

    monkeypatch.setattr(test_store, "make_store", make_store)
    getattr(test_store, name)(tmp_path)
    assert stores  # the check did run against PostgreSQL
    for s in stores:
        s.engine.dispose()


def test_store_reference_import_and_stale_release_on_postgresql(pg_database):
    """test_store's reference-import and stale-release checks, in SQL that PostgreSQL takes too (its
    ROUND has no double-precision form; its driver's parameters are not `?`)."""
    s = Store(pg_database("store_more"))
    s.import_reference(test_store.PAPER_X)
    s.import_reference(test_store.PAPER_X)
    _, rows = s.query("SELECT sweep_kind, ppl_pre, avg_acc FROM results WHERE sweep = 'paper-x'")
    assert rows == [("reference", 20633.0, pytest.approx(0.4))]

    test_store._setup(s)
    test_store._fail_then_retry(s)
    assert s.release_stale() == 0  # its owner is a name, not a process of this host: not stale yet
    with s.tx() as c:  # an owner on this host whose process is gone
        c.execute(
            text("UPDATE jobs SET owner = :o WHERE key = 'j1'"), {"o": f"{socket.gethostname()}:999999"}
        )
    assert s.release_stale() == 1
    assert s.jobs(["j1"])["j1"]["status"] == "pending"
    s.engine.dispose()


# ---- the schema on PostgreSQL: the models agree with it, and a 0001 database upgrades keeping its rows ----
def test_models_agree_with_the_head_schema_on_postgresql(pg_database):
    store = Store(pg_database("head"))
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    diff = [d for d in diff if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []
    store.engine.dispose()


def _plain(v):
    return v.strftime("%Y-%m-%d %H:%M:%S") if isinstance(v, datetime) else v


def test_upgrade_from_0001_keeps_every_row_on_postgresql(pg_database):
    old = Store(pg_database("from_0001"), migrate=False)
    test_migrations.upgrade_to(old, "0001")
    with old.engine.begin() as c:
        for table, rows in test_migrations.ROWS_0001.items():
            for r in rows:
                cols = ", ".join(f'"{k}"' for k in r)
                c.execute(text(f"INSERT INTO {table} ({cols}) VALUES ({', '.join(':' + k for k in r)})"), r)
    old.engine.dispose()
    store = Store(old.url)  # migrates to head
    assert store.query(f"SELECT version_num FROM {VERSION_TABLE}")[1] == [(head_revision(),)]
    for table, rows in test_migrations.ROWS_0001.items():
        got = test_migrations._rows(store, table, list(rows[0]))
        assert [{k: _plain(v) for k, v in r.items()} for r in got] == rows, table
    _, res = store.query(
        "SELECT config_id, ppl_pre, ppl_pre_tokens, avg_acc, variant, variant_of, duplicate_of "
        "FROM results WHERE sweep = 'old' ORDER BY config_id"
    )
    assert res == [(1, 12.5, 10, None, None, None, None), (2, 12.5, 10, 0.5, None, None, 1)]
    for view, n in (
        ("task_scores", 1),
        ("selections", 0),
        ("layer_diagnostics", 0),
        ("curves", 0),
        ("job_status", 1),
        ("config_metrics", 3),
        ("config_code", 2),
    ):
        assert store.query(f"SELECT COUNT(*) FROM {view}")[1] == [(n,)], view
    assert {"variant", "variant_of"} <= {
        c["name"] for c in inspect(store.engine).get_columns("configurations")
    }
    with pytest.raises(Exception, match="foreign key"), store.tx() as c:
        c.execute(text("UPDATE configurations SET variant_of = 99 WHERE id = 2"))
    store.engine.dispose()


def _second_writer_waits_then_succeeds(url: str, table, row: dict, second) -> object:
    """`row` goes into `table` in a transaction left open; `second()` writes the same row from another
    connection meanwhile. It must wait on the row's lock and then go on: the old select-then-insert saw no
    row and broke the unique constraint when the first committed."""
    import threading
    import time

    holder = Store(url)
    out: dict[str, object] = {}
    with holder.engine.connect() as a:
        a.execute(insert(table).values(**row))
        t = threading.Thread(target=lambda: out.setdefault("r", _catch(second)))
        t.start()
        for _ in range(600):  # until the second writer waits on the first's row lock (not a timing assert)
            waiting = a.execute(
                text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
                )
            ).scalar()
            if waiting or not t.is_alive():
                break
            time.sleep(0.05)
        assert waiting, "the second writer never waited on the first's row"
        a.commit()
    t.join(60)
    holder.engine.dispose()
    assert not isinstance(out["r"], BaseException), out["r"]
    return out["r"]


def _catch(f):
    try:
        return f()
    except BaseException as e:  # handed to the main thread, which fails with it
        return e


def test_two_launches_writing_the_same_rows_at_once_wait_and_update_on_postgresql(pg_database):
    """Two launches of one sweep at once (the Ray cluster test's two launches) write the same sweep,
    configurations, jobs and links; each write is one atomic upsert, so the later one waits and updates."""
    url = pg_database("upserts")
    s = Store(url)
    sid = _second_writer_waits_then_succeeds(
        url,
        Sweep,
        {"name": "twice"},
        lambda: s.upsert_sweep("twice", spec_hash="h2"),
    )
    assert s.sweep_id("twice") == sid
    ids = _second_writer_waits_then_succeeds(
        url,
        Configuration,
        {"sweep_id": sid, "config_key": "c", "model": "old", "kind": "dense"},
        lambda: s.upsert_configs(sid, [{"config_key": "c", "model": "new", "kind": "dense"}]),
    )
    assert [c["model"] for c in s.configs(sid)] == ["new"]  # the later write updated the row
    jids = _second_writer_waits_then_succeeds(
        url,
        Job,
        {"key": "k", "stage": "score", "params_json": "{}"},
        lambda: s.register_jobs(sid, [{"key": "k", "stage": "score", "params": {}}]),
    )
    assert set(s.jobs(["k"])) == {"k"} and jids == {"k": s.jobs(["k"])["k"]["id"]}
    s.link([(ids["c"], "score", jids["k"])])
    with s.engine.connect() as c:
        assert c.execute(text("SELECT count(*) FROM sweep_jobs")).scalar() == 1
    s.engine.dispose()
