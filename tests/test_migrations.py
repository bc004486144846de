"""Schema history: a database written at revision 0001 keeps every row through the upgrade to head,
the views answer at head, the models agree with the head schema, and every revision carries the
view SQL it creates (no migration reads a view file at run time)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from db.models import Base
from db.store import VERSION_TABLE, Store, head_revision

ROOT = Path(__file__).resolve().parent.parent
MIGRATIONS = ROOT / "db" / "migrations"

# one row per table, written with raw SQL as revision 0001 knew the tables
ROWS_0001 = {
    "sweeps": [
        {
            "id": 1,
            "name": "old",
            "kind": "own",
            "source": "moesweep",
            "description": "d",
            "spec_yaml": "name: old",
            "spec_hash": "h" * 64,
            "created_at": "2026-01-02 03:04:05",
            "updated_at": "2026-01-02 03:04:06",
        },
    ],
    "jobs": [
        {
            "id": 1,
            "key": "k" * 64,
            "stage": "ppl_pre",
            "params_json": '{"a": 1}',
            "status": "succeeded",
            "attempts": 1,
            "owner": "host:1",
            "heartbeat_at": "2026-01-02 03:04:07",
            "started_at": "2026-01-02 03:04:07",
            "finished_at": "2026-01-02 03:04:08",
            "duration_s": 1.5,
            "compute_s": 1.25,
            "error": None,
            "log_path": "/tmp/x.log",
            "code_version": "abc123",
            "versions_json": '{"torch": "2"}',
            "outputs_json": '{"plan_key": "p"}',
        },
    ],
    "sweep_jobs": [{"id": 1, "sweep_id": 1, "job_id": 1}],
    "configurations": [
        {
            "id": 1,
            "sweep_id": 1,
            "config_key": "SF|RR|uniform|K=4",
            "model": "m",
            "teacher_variant": "instruct",
            "family": "qwen3_moe",
            "kind": "moe2dense",
            "baseline": None,
            "scoring": "SF",
            "grouping": "RR",
            "dp_scaling": "uniform",
            "K": 4,
            "top_k": 2,
            "distill_loss": None,
            "teacher_top_k": None,
            "distill_tokens": "0.3B",
            "source_table": None,
            "selected_for_distill": 1,
            "duplicate_of": None,
            "plan_key": "p",
            "note": "n",
        },
        {
            "id": 2,
            "sweep_id": 1,
            "config_key": "SF|WC|uniform|K=4",
            "model": "m",
            "teacher_variant": "instruct",
            "family": "qwen3_moe",
            "kind": "moe2dense",
            "baseline": None,
            "scoring": "SF",
            "grouping": "WC",
            "dp_scaling": "uniform",
            "K": 4,
            "top_k": 2,
            "distill_loss": "reverse_kl",
            "teacher_top_k": 4,
            "distill_tokens": None,
            "source_table": "t",
            "selected_for_distill": 0,
            "duplicate_of": 1,
            "plan_key": None,
            "note": None,
        },
    ],
    "config_jobs": [
        {"id": 1, "config_id": 1, "stage": "ppl_pre", "job_id": 1},
        {"id": 2, "config_id": 2, "stage": "ppl_pre", "job_id": 1},
    ],
    "metrics": [
        {
            "id": 1,
            "job_id": 1,
            "config_id": None,
            "name": "ppl",
            "stage": "pre",
            "task": "",
            "who": "",
            "step": -1,
            "value": 12.5,
            "value_kind": "finite",
            "sum_nll": 25.26,
            "n_tokens": 10,
            "correct": None,
            "total": None,
            "stderr": None,
            "num_fewshot": None,
            "headline": 0,
            "extra_json": None,
        },
        {
            "id": 2,
            "job_id": None,
            "config_id": 2,
            "name": "acc",
            "stage": "post",
            "task": "mmlu",
            "who": "",
            "step": -1,
            "value": 0.5,
            "value_kind": "finite",
            "sum_nll": None,
            "n_tokens": None,
            "correct": 50.0,
            "total": 100,
            "stderr": 0.05,
            "num_fewshot": 5,
            "headline": 1,
            "extra_json": '{"t": 1}',
        },
    ],
    "artifacts": [
        {
            "id": 1,
            "job_id": 1,
            "kind": "plan",
            "path": "/a/plan.json",
            "content_hash": "c" * 64,
            "size_bytes": 123,
        },
    ],
    "plan_rows": [
        {
            "id": 1,
            "job_id": 1,
            "layer": 0,
            "expert": 3,
            "score": 0.75,
            "selected_rank": 0,
            "group_idx": 1,
            "merge_weight": 0.5,
            "alpha": 0.25,
        },
    ],
    "layer_diag": [{"id": 1, "job_id": 1, "layer": 0, "name": "effective_rank", "value": 1.75}],
}


def alembic_config(url: str) -> Config:
    """The configuration Store.migrate builds (the connection is passed in `attributes`)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_to(store: Store, revision: str) -> None:
    cfg = alembic_config(store.url)
    with store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def write_0001(tmp_path) -> Store:
    store = Store(f"sqlite:///{tmp_path}/old.db", migrate=False)  # foreign keys on, as in real use
    upgrade_to(store, "0001")
    with store.engine.begin() as c:
        for table, rows in ROWS_0001.items():
            for r in rows:
                cols = ", ".join(f'"{k}"' for k in r)
                c.execute(text(f"INSERT INTO {table} ({cols}) VALUES ({', '.join(':' + k for k in r)})"), r)
    return store


def _rows(store: Store, table: str, cols: list[str]) -> list[dict]:
    quoted = ", ".join(f'"{c}"' for c in cols)
    _, rows = store.query(f"SELECT {quoted} FROM {table} ORDER BY id")
    return [dict(zip(cols, r, strict=True)) for r in rows]


def test_upgrade_from_0001_keeps_every_row_and_views_answer(tmp_path):
    old = write_0001(tmp_path)
    assert old.query(f"SELECT version_num FROM {VERSION_TABLE}")[1] == [("0001",)]
    assert "variant" not in {c["name"] for c in inspect(old.engine).get_columns("configurations")}
    store = Store(old.url)  # opening the store migrates to head
    assert store.query(f"SELECT version_num FROM {VERSION_TABLE}")[1] == [(head_revision(),)]
    for table, rows in ROWS_0001.items():
        assert _rows(store, table, list(rows[0])) == rows, table
    _, new = store.query("SELECT variant, variant_of FROM configurations ORDER BY id")
    assert new == [(None, None), (None, None)]
    assert store.query("SELECT code_json FROM jobs")[1] == [(None,)]
    assert store.query("SELECT select_json FROM sweeps")[1] == [(None,)]
    assert store.query("SELECT inputs_json FROM jobs")[1] == [(None,)]
    assert store.query("SELECT output, recovery FROM configurations")[1] == [(None, None), (None, None)]
    assert store.query("SELECT mtime FROM artifacts")[1] == [(None,)]  # checked by hash on first use
    _, res = store.query(
        "SELECT config_id, ppl_pre, ppl_pre_tokens, avg_acc, variant, variant_of, duplicate_of "
        "FROM results WHERE sweep = 'old' ORDER BY config_id"
    )
    assert res == [(1, 12.5, 10, None, None, None, None), (2, 12.5, 10, 0.5, None, None, 1)]
    _, code = store.query(
        "SELECT sweep, config_id, stage, job_id, job_key, code_version, code_json "
        "FROM config_code ORDER BY config_id"
    )
    assert code == [
        ("old", 1, "ppl_pre", 1, "k" * 64, "abc123", None),
        ("old", 2, "ppl_pre", 1, "k" * 64, "abc123", None),
    ]
    _, info = store.query("SELECT sweep, kind, source, select_json FROM sweep_info")
    assert info == [("old", "own", "moesweep", None)]
    for view, n in (
        ("task_scores", 1),
        ("selections", 0),
        ("layer_diagnostics", 0),
        ("curves", 0),
        ("job_status", 1),
        ("config_metrics", 3),
    ):
        assert store.query(f"SELECT COUNT(*) FROM {view}")[1] == [(n,)], view
    # the new columns take values and the FK holds
    with store.tx() as c:
        c.execute(text("UPDATE configurations SET variant = 'loss=reverse_kl', variant_of = 1 WHERE id = 2"))
    assert store.query("SELECT variant, variant_of FROM results WHERE config_id = 2")[1] == [
        ("loss=reverse_kl", 1)
    ]
    with pytest.raises(Exception, match="FOREIGN KEY"), store.tx() as c:
        c.execute(text("UPDATE configurations SET variant_of = 99 WHERE id = 2"))


def test_downgrade_to_0001_keeps_rows_and_refuses_with_foreign_keys_on(tmp_path):
    store = Store(write_0001(tmp_path).url)
    with pytest.raises(RuntimeError, match="foreign_keys=OFF"):
        cfg = alembic_config(store.url)
        with store.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.downgrade(cfg, "0001")
    assert _rows(store, "metrics", list(ROWS_0001["metrics"][0])) == ROWS_0001["metrics"]
    plain = create_engine(store.url)  # the alembic CLI's engine: SQLite's default, foreign keys off
    cfg = alembic_config(store.url)
    with plain.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0001")
    plain.dispose()
    for table, rows in ROWS_0001.items():
        assert _rows(store, table, list(rows[0])) == rows, table
    assert "code_json" not in {c["name"] for c in inspect(store.engine).get_columns("jobs")}
    assert store.query("SELECT COUNT(*) FROM results")[1] == [(2,)]
    assert "config_code" not in inspect(store.engine).get_view_names()


def test_models_agree_with_the_head_schema(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/head.db")
    with store.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    diff = [d for d in diff if not (d[0] == "remove_table" and d[1].name == VERSION_TABLE)]
    assert diff == []
    insp = inspect(store.engine)
    for table in Base.metadata.sorted_tables:
        assert {c["name"] for c in insp.get_columns(table.name)} == set(table.columns.keys()), table.name


def test_every_revision_carries_its_own_view_sql():
    from db.views import statements

    versions = sorted((MIGRATIONS / "versions").glob("0*.py"))
    assert [p.name[:4] for p in versions] == [f"{i:04d}" for i in range(1, len(versions) + 1)]
    assert not (ROOT / "db" / "views.sql").exists()
    for p in versions:
        tree = ast.parse(p.read_text())
        consts = {
            t.id: n.value.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)
        }
        created = [s.split()[2] for s in statements(consts["VIEWS_SQL"])]
        assert created or p.name.startswith(("0003", "0008"))  # columns no view reads / values: no views
        assert all(s.startswith("CREATE VIEW") for s in statements(consts["VIEWS_SQL"]))
        assert "resources" not in p.read_text() and ".sql" not in p.read_text(), p.name
        names = {
            e.value
            for n in tree.body
            if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "VIEWS" for t in n.targets)
            for e in n.value.elts
        }
        assert names == set(created), p.name


def test_statements_split_at_line_end_semicolons():
    from db.views import statements

    sql = "-- a comment; not a statement\nCREATE VIEW a AS SELECT ';' AS x;\n\nCREATE VIEW b AS\nSELECT 1;"
    assert statements(sql) == ["CREATE VIEW a AS SELECT ';' AS x", "CREATE VIEW b AS\nSELECT 1"]
