"""smaller MoEs get their own kind: configurations.kind = 'moe2moe' where the output keeps a router

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25

A configuration of the grid was stored with `kind = 'moe2dense'` whatever its output, so a smaller MoE (a
pruned, merged or edited MoE: `output` moe, merged or edited) read as a dense student to any query that
filtered on `kind`. From this revision a grid configuration's kind says what it is: `moe2dense` (a dense
student), `moe2moe` (a smaller MoE), besides `dense2moe` (DOT-MoE), `baseline` and `teacher`. Existing rows
are rewritten by their `output`; no view changes (they show the column as stored).
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

VIEWS = ()  # no view changes: they show the column as stored
VIEWS_SQL = ""
SMALLER = ("moe", "merged", "edited")  # this revision's smaller MoEs (its own copy, as views are copied)


def upgrade() -> None:
    outputs = ", ".join(f"'{o}'" for o in SMALLER)
    op.execute(
        f"UPDATE configurations SET kind = 'moe2moe' WHERE kind = 'moe2dense' AND output IN ({outputs})"
    )


def downgrade() -> None:
    op.execute("UPDATE configurations SET kind = 'moe2dense' WHERE kind = 'moe2moe'")
