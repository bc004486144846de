"""artifact checks: artifacts.mtime, jobs.inputs_json

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23

`artifacts.mtime` (seconds; of a folder: the latest over it and everything in it) lets a launch check an
artifact cheaply (size and mtime) before it is used, hashing it only when either changed.
`jobs.inputs_json` ({upstream job key: {artifact path: content hash}}) is what a job read: when an
upstream job is recomputed with different content, the jobs that read the old content are recomputed.
No view changes (no view reads these columns), so this revision carries no view SQL. Both columns are
added and dropped in place (SQLite >= 3.35 drops a column no view or index names without copying the
table), so neither direction rewrites the tables.
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

VIEWS = ()  # created here: none
VIEWS_SQL = ""


def upgrade() -> None:
    op.add_column("artifacts", sa.Column("mtime", sa.Float(), nullable=True))
    op.add_column("jobs", sa.Column("inputs_json", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "inputs_json")
    op.drop_column("artifacts", "mtime")
