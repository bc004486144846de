"""Stage order lives in the database (table `stages`, revision 0007): a launch records the order it runs its
stages in, the dashboard orders stages by it without importing the orchestrator, and a database no launch
has recorded an order in yet orders them as its jobs first name them."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, inspect
from test_migrations import alembic_config

from dashboard import data as D
from db.store import Store
from orchestrator.stage import stages
from tests.test_orchestrator import _launch, fake  # noqa: F401  (the fake stage functions fixture)


def _store(tmp_path) -> Store:
    return Store(f"sqlite:///{tmp_path}/s.db")


def _jobs(store: Store, sweep: str, stages: list[str]) -> None:
    sid = store.upsert_sweep(sweep)
    store.register_jobs(
        sid, [{"key": f"{sweep}-{i}-{s}", "stage": s, "params": {"i": i}} for i, s in enumerate(stages)]
    )


def _positions(store: Store) -> list[tuple[str, int]]:
    return store.query("SELECT name, position FROM stages ORDER BY position")[1]


def test_a_recorded_order_is_replaced_only_when_it_changed(tmp_path):
    store = _store(tmp_path)
    assert _positions(store) == [] and store.stage_order() == []
    store.record_stages(["teacher", "convert", "ppl_pre"])
    assert _positions(store) == [("teacher", 0), ("convert", 1), ("ppl_pre", 2)]
    store.record_stages(iter(["teacher", "convert", "ppl_pre"]))  # the same: nothing written
    assert _positions(store) == [("teacher", 0), ("convert", 1), ("ppl_pre", 2)]
    store.record_stages(["teacher", "calibrate", "convert"])  # one new, one gone, one moved
    assert _positions(store) == [("teacher", 0), ("calibrate", 1), ("convert", 2)]
    assert store.stage_order() == ["teacher", "calibrate", "convert"]


def test_without_a_recorded_order_stages_follow_the_jobs_first_naming_them(tmp_path):
    store = _store(tmp_path)
    _jobs(store, "a", ["evaluate", "convert", "evaluate", "ppl_pre"])
    _jobs(store, "b", ["distill", "convert"])
    assert store.stage_order() == ["evaluate", "convert", "ppl_pre", "distill"]
    store.record_stages(["convert", "ppl_pre", "evaluate"])  # recorded first, the rest as first seen
    assert store.stage_order() == ["convert", "ppl_pre", "evaluate", "distill"]


def test_the_dashboard_orders_stages_from_the_database(tmp_path):
    store = _store(tmp_path)
    _jobs(store, "a", ["evaluate", "convert", "ppl_pre"])
    ro = Store(store.url, read_only=True)
    assert list(D.stage_counts(ro)["a"]) == ["evaluate", "convert", "ppl_pre"]  # as first seen
    assert [j["stage"] for j in D.sweep_jobs(ro, "a")] == ["evaluate", "convert", "ppl_pre"]
    store.record_stages(["convert", "ppl_pre", "evaluate"])
    assert list(D.stage_counts(ro)["a"]) == ["convert", "ppl_pre", "evaluate"]
    assert list(D.progress(ro, "a")["stages"]) == ["convert", "ppl_pre", "evaluate"]
    assert [j["stage"] for j in D.sweep_jobs(ro, "a")] == ["convert", "ppl_pre", "evaluate"]
    _, rows = ro.query("SELECT stage, stage_position, jobs FROM job_status ORDER BY stage_position")
    assert rows == [("convert", 0, 1), ("ppl_pre", 1, 1), ("evaluate", 2, 1)]


def test_migration_0007_down_and_up(tmp_path):
    store = _store(tmp_path)
    _jobs(store, "a", ["convert"])
    store.record_stages(["convert"])
    plain = create_engine(store.url)  # the alembic CLI's engine: SQLite's default, foreign keys off
    cfg = alembic_config(store.url)
    with plain.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0006")
    assert "stages" not in inspect(plain).get_table_names()
    assert [c["name"] for c in inspect(plain).get_columns("job_status")] == [
        "sweep",
        "stage",
        "status",
        "jobs",
    ]
    with plain.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")
    plain.dispose()
    assert store.query("SELECT sweep, stage, stage_position, status, jobs FROM job_status")[1] == [
        ("a", "convert", None, "pending", 1)
    ]
    assert store.stage_order() == ["convert"]  # from the job, until a launch records the order again


def test_a_launch_records_the_order_it_runs_its_stages_in(fake, tmp_path):  # noqa: F811
    calls, state = fake
    store = Store(state["db"])
    state["fail"] = False
    assert _launch(store, state["sweep"]) == 0
    order = [s.name for s in stages()]
    assert [n for n, _ in _positions(store)] == order
    shown = list(D.stage_counts(Store(store.url, read_only=True))["fake"])
    assert shown == [s for s in order if s in shown] and {name for name, _ in calls} <= set(shown)
