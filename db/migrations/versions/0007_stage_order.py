"""stage order in the database: table stages; job_status shows each stage's position

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25

`stages` holds the order a launch runs its stages in (`name`, `position` from 0), written by the
orchestrator at the start of every launch (replaced when the order changed), so a reader orders stages
from the database alone and never imports the orchestrator's stage registry. A database no launch has
written it in since this revision has no rows: readers then order stages as the jobs first name them.
`job_status` gains `stage_position` (NULL for a stage the table does not hold).
Like every revision it carries its own copy of the view SQL it creates.
"""

import importlib

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script, statements

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

VIEWS = ("job_status",)  # created here (dropped first on downgrade)
VIEWS_SQL = """
-- job_status: how far each sweep is, per stage and status; stage_position: the stage's place in the
-- launch order (table stages), NULL for a stage no launch recorded.
CREATE VIEW job_status AS
SELECT s.name AS sweep, j.stage AS stage, st.position AS stage_position, j.status AS status, COUNT(*) AS jobs
FROM sweeps s JOIN sweep_jobs sj ON sj.sweep_id = s.id JOIN jobs j ON j.id = sj.job_id
LEFT JOIN stages st ON st.name = j.stage
GROUP BY s.name, j.stage, st.position, j.status;
"""


def upgrade() -> None:
    conn = op.get_bind()
    drop_views(conn, VIEWS)
    op.create_table(
        "stages",
        sa.Column("name", sa.String(length=40), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("name"),
    )
    execute_script(conn, VIEWS_SQL)


def downgrade() -> None:
    conn = op.get_bind()
    previous = importlib.import_module("db.migrations.versions.0001_initial_schema")  # job_status's last
    drop_views(conn, VIEWS)
    op.drop_table("stages")
    for stmt in statements(previous.VIEWS_SQL):
        if stmt.split()[2] in VIEWS:
            execute_script(conn, stmt)
