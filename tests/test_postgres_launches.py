"""Launches against SQLite and PostgreSQL alike: a launch waiting on a job that another launch of the same
sweep runs (and that fails) lists it and exits non-zero; a launch SIGKILLed at several points and resumed
ends with the rows of an uninterrupted run, and never runs a job again once it succeeded. The second
launch with drivers on different Ray nodes sharing one PostgreSQL is tests/test_ray_cluster.py's."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from db.store import Store
from tests import test_failures
from tests.ray_cluster import SWEEP, launch
from tests.test_orchestrator import fake, fake_sweep  # noqa: F401  (the fake stage functions fixture)


def test_a_launch_waiting_on_a_job_that_fails_elsewhere_on_postgresql(
    fake,  # noqa: F811
    monkeypatch,
    tmp_path,
    pg_database,
):
    """test_failures' two concurrent launches (one waits on the other's failing job), on PostgreSQL."""
    calls, state = fake
    state["db"] = pg_database("waiting")
    test_failures.test_a_launch_waiting_on_a_job_that_fails_elsewhere_lists_it_and_exits_non_zero(
        fake, monkeypatch, tmp_path
    )


RESULTS = (
    "SELECT c.config_key, r.ppl_pre FROM results r JOIN configurations c ON c.id = r.config_id "
    "WHERE r.sweep = 'cluster' ORDER BY c.config_key"
)
PER_JOB = (
    "SELECT j.stage, j.status, COUNT(m.id) FROM jobs j LEFT JOIN metrics m ON m.job_id = j.id "
    "GROUP BY j.id, j.stage, j.status"
)


def _done(store: Store) -> dict[str, tuple]:
    return {
        k: (a, str(f))
        for k, a, f in store.query("SELECT key, attempts, finished_at FROM jobs WHERE status = 'succeeded'")[
            1
        ]
    }


def _run(sweep: Path, db: str, home: Path, kill_at: int | None = None) -> bool:
    """A serial launch with the fake stages; SIGKILLed (its process group) once `kill_at` jobs succeeded.
    True if it was killed."""
    proc = launch(None, sweep, db, home, start_new_session=True)
    store = Store(db, migrate=False) if kill_at else None
    try:
        t0 = time.monotonic()
        while kill_at and proc.poll() is None and time.monotonic() - t0 < 120:
            try:
                n = store.query("SELECT COUNT(*) FROM jobs WHERE status = 'succeeded'")[1][0][0]
            except Exception:  # the schema is not there yet
                n = 0
            if n >= kill_at:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.05)
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == 0, out
        return False
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if store is not None:
            store.engine.dispose()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    sweep, home = fake_sweep(tmp, SWEEP), tmp / "home"
    home.mkdir()
    db = f"sqlite:///{tmp}/ref.db"
    _run(sweep, db, home)
    store = Store(db, migrate=False)
    yield store.query(RESULTS)[1], sorted(store.query(PER_JOB)[1])
    store.engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_kill_9_then_resume_equals_an_uninterrupted_run(backend, uninterrupted, tmp_path, request):
    sweep, home = fake_sweep(tmp_path, SWEEP), tmp_path / "home"
    home.mkdir()
    db = (
        f"sqlite:///{tmp_path}/k.db"
        if backend == "sqlite"
        else request.getfixturevalue("pg_database")("kill9")
    )
    seen: dict[str, tuple] = {}
    for point in (1, 5):  # after the calibration; among the conversions and perplexities
        assert _run(sweep, db, home, kill_at=point), "the launch ended before it was killed"
        store = Store(db, migrate=False)
        done = _done(store)
        store.engine.dispose()
        assert all(done[k] == v for k, v in seen.items())  # a job that had succeeded never ran again
        seen = done
    _run(sweep, db, home)
    store = Store(db, migrate=False)
    assert all(_done(store)[k] == v for k, v in seen.items())
    rows, per_job = uninterrupted
    assert store.query(RESULTS)[1] == rows  # the same rows, none lost or duplicated
    assert sorted(store.query(PER_JOB)[1]) == per_job  # the same metrics per job: none written twice
    ran = [json.loads(ln)["key"] for ln in (home / "runs.jsonl").read_text().splitlines()]
    assert all(ran.count(k) == 1 for k in seen)  # (only a job in flight at a kill ran again)
    store.engine.dispose()
