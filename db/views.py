"""Run a SQL script of `;`-separated statements (the migrations' view definitions).

Each migration carries its own copy of the view SQL it creates, so editing a view never rewrites
an earlier revision: changing a view is a new migration with the new SQL.
"""

from __future__ import annotations

import re

from sqlalchemy import text


def statements(sql: str) -> list[str]:
    """The statements of `sql`: `--` comment lines dropped, split at a `;` that ends a line."""
    body = "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
    return [s.strip().rstrip(";").strip() for s in re.split(r";[ \t]*(?:\n|$)", body) if s.strip()]


def execute_script(conn, sql: str) -> None:
    for stmt in statements(sql):
        conn.execute(text(stmt))


def drop_views(conn, names) -> None:
    for name in names:
        conn.execute(text(f"DROP VIEW IF EXISTS {name}"))
