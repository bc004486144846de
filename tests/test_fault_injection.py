"""Faults injected into launches, then resumed: the results equal an uninterrupted run's.

Here with fake stage functions; `benchmarks/fault_injection.py --smoke` (run by tests/test_benchmarks.py)
injects real faults (SIGKILLs of a launch, a raising job, corrupted artifacts) into a real small sweep.
"""

from __future__ import annotations

from rich.console import Console

import workers.stages as stages
from db.store import Store
from orchestrator.execute import SerialExecutor
from orchestrator.launch import launch
from orchestrator.spec import load_spec
from tests.test_orchestrator import fake  # noqa: F401  (the fake stage functions fixture)


def _results(store: Store) -> list[tuple]:
    return store.query("SELECT c.config_key, r.ppl_pre, r.selected_for_distill, r.ppl_post, r.avg_acc "
                       "FROM results r JOIN configurations c ON c.id = r.config_id ORDER BY c.config_key")[1]


def test_a_failure_that_moved_the_selection_leaves_nothing_behind_once_resumed(fake, monkeypatch, tmp_path):  # noqa: F811
    """A failed conversion makes a launch distill the second-best configuration; resumed with --retry-failed,
    the best one is distilled and the other one shows no distilled numbers any more, as in a run without
    the failure (its distillation job stays in the database, unlinked)."""
    calls, state = fake
    ppl_pre = stages.stage_ppl_pre

    def best_at_k4(p, cache, progress):  # CP at K = 4 (the conversions that fail) wins its pairs when it runs
        rec = ppl_pre(p, cache, progress)
        if p["params"]["student"].get("plan_key", "").startswith("CP|") and p["params"]["student"]["plan_key"] \
                .endswith("|4"):
            rec["outputs"]["ppl"] = rec["metrics"][0]["value"] = 1.0
        return rec

    monkeypatch.setattr(stages, "stage_ppl_pre", best_at_k4)
    spec, path, text = load_spec(str(state["sweep"]))

    def run(store: Store, **kw) -> int:
        return launch(spec, text, store, SerialExecutor(), console=Console(quiet=True), show_progress=False,
                      path=str(path), **kw)

    state["fail"], db = False, state["db"]
    state["db"] = f"sqlite:///{tmp_path}/reference.db"  # (the fake distillation reads the launch's database)
    ref = Store(state["db"])
    assert run(ref) == 0
    state["db"] = db
    expected = _results(ref)
    assert [r[0] for r in expected if r[2] and r[0].startswith("CP|")] == ["CP|RR|uniform|K=4", "CP|WC|uniform|K=4"]

    state["fail"] = True
    store = Store(state["db"])
    assert run(store) == 1  # CP at K = 4 failed: CP at K = 2 was distilled instead
    assert any(r[0].startswith("CP|") and r[0].endswith("K=2") and r[3] is not None for r in _results(store))
    state["fail"] = False
    assert run(store, retry_failed=True) == 0
    assert _results(store) == expected
    # the distillation of CP at K = 2 is still a job in the database: a later selection may reuse it
    assert store.query("SELECT COUNT(*) FROM jobs WHERE stage = 'distill'")[1][0][0] > \
        ref.query("SELECT COUNT(*) FROM jobs WHERE stage = 'distill'")[1][0][0]
