"""The results database: migrations, atomic claims, idempotent writes, explicit non-finite values."""

from __future__ import annotations

import multiprocessing as mp

from sqlalchemy import inspect

from db.store import Store, head_revision


def make_store(tmp_path) -> Store:
    return Store(f"sqlite:///{tmp_path}/t.db")


def test_migration_creates_schema_views_and_own_version_table(tmp_path):
    s = make_store(tmp_path)
    insp = inspect(s.engine)
    tables = set(insp.get_table_names())
    assert {"sweeps", "jobs", "configurations", "metrics", "artifacts", "plan_rows"} <= tables
    assert "moesweep_alembic_version" in tables and "alembic_version" not in tables
    assert {"results", "task_scores", "selections", "curves", "layer_diagnostics"} <= set(
        insp.get_view_names()
    )
    Store(s.url)  # migrating again is a no-op
    _, rows = s.query("SELECT version_num FROM moesweep_alembic_version")
    assert rows == [(head_revision(),)]


def test_sqlite_pragmas(tmp_path):
    s = make_store(tmp_path)
    assert s.query("PRAGMA journal_mode")[1][0][0] == "wal"
    assert s.query("PRAGMA foreign_keys")[1][0][0] == 1
    assert s.query("PRAGMA busy_timeout")[1][0][0] == 30000


def _setup(s: Store):
    sid = s.upsert_sweep("x", spec_yaml="name: x")
    ids = s.register_jobs(sid, [{"key": "j1", "stage": "ppl_pre", "params": {"a": 1}}])
    cids = s.upsert_configs(
        sid,
        [
            {
                "config_key": "c1",
                "model": "m",
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 4,
                "top_k": 2,
            },
            {
                "config_key": "c2",
                "model": "m",
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": "WC",
                "dp_scaling": "uniform",
                "K": 4,
                "top_k": 2,
            },
        ],
    )
    s.link([(cids["c1"], "ppl_pre", ids["j1"]), (cids["c2"], "ppl_pre", ids["j1"])])
    return sid, ids, cids


def test_claim_is_exclusive_and_finish_is_idempotent(tmp_path):
    s = make_store(tmp_path)
    sid, ids, cids = _setup(s)
    assert s.claim("j1", "a") and not s.claim("j1", "b")
    rec = {"metrics": [{"name": "ppl", "stage": "pre", "value": 12.5, "sum_nll": 25.26, "n_tokens": 10}]}
    assert s.finish("j1", "a", rec, 1.0)
    assert not s.finish("j1", "a", rec, 1.0)  # not running any more: nothing is written twice
    assert not s.claim("j1", "b")  # succeeded jobs are never run again
    _, rows = s.query("SELECT config_id, ppl_pre, ppl_pre_tokens FROM results ORDER BY config_id")
    assert rows == [(cids["c1"], 12.5, 10), (cids["c2"], 12.5, 10)]  # two configs share one job
    _, n = s.query("SELECT COUNT(*) FROM metrics")
    assert n == [(1,)]


def test_non_finite_values_are_explicit(tmp_path):
    s = make_store(tmp_path)
    _setup(s)
    s.claim("j1", "a")
    s.finish(
        "j1",
        "a",
        {
            "metrics": [
                {"name": "ppl", "stage": "pre", "value": float("inf")},
                {"name": "ppl", "stage": "post", "value": float("nan")},
            ]
        },
        1.0,
    )
    _, rows = s.query("SELECT ppl_pre, ppl_pre_kind, ppl_post, ppl_post_kind FROM results LIMIT 1")
    assert rows == [(None, "inf", None, "nan")]


def _fail_then_retry(s: Store) -> None:
    """j1 (of `_setup`) fails for good under owner a; b may claim it only as a retry, and is running it."""
    s.claim("j1", "a")
    s.fail("j1", "a", "Traceback ...\nValueError: boom", final=True)
    assert s.jobs(["j1"])["j1"]["status"] == "failed"
    assert not s.claim("j1", "b")
    assert s.claim("j1", "b", retry_failed=True)
    s.heartbeat(["j1"], "b")


def test_failure_then_retry_and_stale_release(tmp_path):
    s = make_store(tmp_path)
    _setup(s)
    _fail_then_retry(s)
    # an owner on this host whose process is gone: its running job goes back to pending
    with s.tx() as c:
        c.exec_driver_sql(
            "UPDATE jobs SET owner = ? WHERE key = 'j1'", (f"{__import__('socket').gethostname()}:999999",)
        )
    assert s.release_stale() == 1
    assert s.jobs(["j1"])["j1"]["status"] == "pending"


def _claim_worker(url: str, n: int, q) -> None:
    s = Store(url, migrate=False)
    won = [k for k in (f"k{i}" for i in range(n)) if s.claim(k, f"proc-{mp.current_process().pid}")]
    q.put(won)


def test_concurrent_claims_never_double_run(tmp_path):
    s = make_store(tmp_path)
    sid = s.upsert_sweep("x")
    n = 40
    s.register_jobs(sid, [{"key": f"k{i}", "stage": "convert", "params": {"i": i}} for i in range(n)])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_claim_worker, args=(s.url, n, q)) for _ in range(3)]
    for p in procs:
        p.start()
    won = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    flat = [k for w in won for k in w]
    assert sorted(flat) == sorted(f"k{i}" for i in range(n))  # each job claimed exactly once


# one reference record of a paper's table: a pruned model's perplexity and two task scores
PAPER_X = [
    {
        "name": "paper-x",
        "source": "paper:000",
        "configs": [
            {
                "model": "M",
                "kind": "moe2dense",
                "scoring": "SF",
                "grouping": "RR",
                "dp_scaling": "uniform",
                "K": 8,
                "top_k": 8,
                "table": "table10_11",
                "metrics": [
                    {"name": "ppl", "stage": "pre", "value": 20633.0},
                    {"name": "acc", "stage": "post", "task": "winogrande", "value": 0.53, "headline": 1},
                    {"name": "acc", "stage": "post", "task": "mmlu", "value": 0.27, "headline": 1},
                ],
            }
        ],
    }
]


def test_reference_import_is_idempotent(tmp_path):
    s = make_store(tmp_path)
    s.import_reference(PAPER_X)
    s.import_reference(PAPER_X)
    _, rows = s.query("SELECT sweep_kind, ppl_pre, ROUND(avg_acc, 4) FROM results WHERE sweep = 'paper-x'")
    assert rows == [("reference", 20633.0, 0.4)]


def test_release_gives_back_every_running_job_of_one_owner(tmp_path):
    s = make_store(tmp_path)
    sid = s.upsert_sweep("x")
    s.register_jobs(sid, [{"key": k, "stage": "convert", "params": {"k": k}} for k in ("a1", "a2", "b1")])
    assert s.claim("a1", "a") and s.claim("a2", "a") and s.claim("b1", "b")
    assert s.release("a") == 2  # also a job its owner claimed but had not noted yet
    jobs = s.jobs(["a1", "a2", "b1"])
    assert [jobs[k]["status"] for k in ("a1", "a2", "b1")] == ["pending", "pending", "running"]
    assert jobs["a1"]["attempts"] == 0 and s.release("b", "b1") == 1


def test_upsert_sweep_stores_the_selection_rule(tmp_path):
    s = make_store(tmp_path)
    rule = '{"best_by": "ppl_pre", "over": ["K"], "per": ["scoring"]}'
    sid = s.upsert_sweep("x", select_json=rule)
    assert s.query("SELECT select_json FROM sweep_info WHERE sweep = 'x'")[1] == [(rule,)]
    assert s.upsert_sweep("x") == sid  # an update rewrites it like every other field
    assert s.query("SELECT select_json FROM sweeps WHERE id = :i", {"i": sid})[1] == [(None,)]
