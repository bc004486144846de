"""Faults injected into launches, then resumed: the results equal an uninterrupted run's.

Here with fake stage functions; `benchmarks/fault_injection.py --smoke` (run by tests/test_benchmarks.py)
injects real faults (SIGKILLs of a launch, a raising job, corrupted artifacts) into a real small sweep.
"""

from __future__ import annotations

from rich.console import Console
from sweep_runs import launch_serial

import workers.run.ppl_pre
from db.store import Store
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake  # noqa: F401  (the fake stage functions fixture)


def _results(store: Store) -> list[tuple]:
    return store.query(
        "SELECT c.config_key, r.ppl_pre, r.selected_for_distill, r.ppl_post, r.avg_acc "
        "FROM results r JOIN configurations c ON c.id = r.config_id ORDER BY c.config_key"
    )[1]


def test_a_failure_that_moved_the_selection_leaves_nothing_behind_once_resumed(fake, monkeypatch, tmp_path):  # noqa: F811
    """A failed conversion makes a launch distill the second-best configuration; resumed with --retry-failed,
    the best one is distilled and the other one shows no distilled numbers any more, as in a run without
    the failure (its distillation job stays in the database, unlinked)."""
    calls, state = fake
    ppl_pre = workers.run.ppl_pre.stage_ppl_pre

    def best_at_k4(p, cache, progress):  # CP at K = 4 (the conversions that fail) wins its pairs when it runs
        rec = ppl_pre(p, cache, progress)
        if p["params"]["student"].get("plan_key", "").startswith("CP|") and p["params"]["student"][
            "plan_key"
        ].endswith("|4"):
            rec["outputs"]["ppl"] = rec["metrics"][0]["value"] = 1.0
        return rec

    monkeypatch.setattr("workers.run.ppl_pre.stage_ppl_pre", best_at_k4)
    spec, path, text = load_spec(str(state["sweep"]))

    def run(store: Store, **kw) -> int:
        return launch_serial(spec, text, store, path, **kw)

    state["fail"], db = False, state["db"]
    state["db"] = f"sqlite:///{tmp_path}/reference.db"  # (the fake distillation reads the launch's database)
    ref = Store(state["db"])
    assert run(ref) == 0
    state["db"] = db
    expected = _results(ref)
    assert [r[0] for r in expected if r[2] and r[0].startswith("CP|")] == [
        "CP|RR|uniform|K=4",
        "CP|WC|uniform|K=4",
    ]

    state["fail"] = True
    store = Store(state["db"])
    assert run(store) == 1  # CP at K = 4 failed: CP at K = 2 was distilled instead
    assert any(r[0].startswith("CP|") and r[0].endswith("K=2") and r[3] is not None for r in _results(store))
    state["fail"] = False
    assert run(store, retry_failed=True) == 0
    assert _results(store) == expected
    # the distillation of CP at K = 2 is still a job in the database: a later selection may reuse it
    assert (
        store.query("SELECT COUNT(*) FROM jobs WHERE stage = 'distill'")[1][0][0]
        > ref.query("SELECT COUNT(*) FROM jobs WHERE stage = 'distill'")[1][0][0]
    )


def test_a_database_locked_past_the_busy_timeout_stops_the_launch_with_one_line_and_it_resumes(
    fake,  # noqa: F811
    monkeypatch,
):
    """The database stays locked while a job's result is written (another process holds it past the busy
    timeout): the launch stops with one line and exit 2, no traceback; the next launch takes over the jobs
    it held and ends as an undisturbed run does."""
    import io

    from sqlalchemy.exc import OperationalError

    calls, state = fake
    state["fail"] = False
    store = Store(state["db"])
    finish, fail = Store.finish, Store.fail
    n = {"finished": 0}

    def locked_after_three(self, *a, **kw):
        n["finished"] += 1
        if n["finished"] > 3:
            raise OperationalError("UPDATE jobs ...", {}, Exception("database is locked"))
        return finish(self, *a, **kw)

    monkeypatch.setattr(Store, "finish", locked_after_three)
    monkeypatch.setattr(Store, "fail", lambda self, *a, **kw: locked_after_three(self))
    spec, path, text = load_spec(str(state["sweep"]))
    out = io.StringIO()
    code = launch(
        spec,
        text,
        store,
        SerialExecutor(),
        console=Console(file=out, width=400),
        show_progress=False,
        path=str(path),
        owner="elsewhere:1",
    )
    assert code == 2
    lines = [ln for ln in out.getvalue().splitlines() if ln.strip()]
    assert lines[0].startswith("error: ") and "is locked by another process" in lines[0], out.getvalue()
    assert "Traceback" not in out.getvalue()
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status = 'succeeded'")[1] == [(3,)]

    monkeypatch.setattr(Store, "finish", finish)
    monkeypatch.setattr(Store, "fail", fail)
    with store.tx() as c:  # its owner is gone (here: another host's launch whose heartbeat is old)
        c.exec_driver_sql(
            "UPDATE jobs SET heartbeat_at = datetime('now', '-1 hour') WHERE status = 'running'"
        )
    assert launch_serial(spec, text, store, path) == 0
    assert store.query("SELECT COUNT(*) FROM jobs WHERE status <> 'succeeded' OR attempts > 2")[1] == [(0,)]
