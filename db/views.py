"""Create and drop the SQL views in views.sql (used by the migrations)."""

from __future__ import annotations

import re
from importlib import resources

from sqlalchemy import text

VIEWS = ("job_status", "curves", "layer_diagnostics", "selections", "task_scores", "results",
         "config_metrics")


def view_statements() -> list[str]:
    sql = resources.files("db").joinpath("views.sql").read_text()
    sql = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip() for s in re.split(r";\s*\n", sql) if s.strip()]


def create_views(conn) -> None:
    for stmt in view_statements():
        conn.execute(text(stmt.rstrip(";")))


def drop_views(conn) -> None:
    for name in VIEWS:
        conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
