"""output mode and recovery: configurations.output, configurations.recovery; results shows them and params

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23

Two axes of the grid become columns: `output` (what a configuration's conversion writes: `dense`, the
core paper's dense student, or `moe`, a smaller MoE with the kept experts and their router rows) and
`recovery` (what recovers a smaller MoE before evaluation: `none` or `router_kd`). Rows written before
this revision are dense students (`output` NULL reads as dense). `results` gains both and `params`,
the student's parameter count as measured on the model built for its pre-distillation evaluation,
and `config_key`.
Like every revision it carries its own copy of the view SQL it creates.
"""

import importlib

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

VIEWS = ("results",)  # created here (dropped first on downgrade)
VIEWS_SQL = """
-- results: one row per configuration, its axes and headline numbers. Accuracies are fractions.
-- output: dense | moe; recovery: none | router_kd (moe outputs); params: the student's measured size.
CREATE VIEW results AS
SELECT s.name AS sweep, s.kind AS sweep_kind, s.source AS source, c.id AS config_id,
       c.config_key AS config_key, c.model AS model, c.teacher_variant AS teacher_variant, c.family AS family, c.kind AS kind,
       c.baseline AS baseline, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", c.output AS output, c.recovery AS recovery,
       c.top_k AS top_k, c.distill_loss AS distill_loss,
       c.teacher_top_k AS teacher_top_k, c.distill_tokens AS distill_tokens,
       c.variant AS variant, c.variant_of AS variant_of,
       c.selected_for_distill AS selected_for_distill, c.duplicate_of AS duplicate_of,
       c.plan_key AS plan_key, c.source_table AS source_table,
       (SELECT m.value FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre,
       (SELECT m.value_kind FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre_kind,
       (SELECT m.sum_nll FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre_sum_nll,
       (SELECT m.n_tokens FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre_tokens,
       (SELECT m.value FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post,
       (SELECT m.value_kind FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post_kind,
       (SELECT AVG(m.value) FROM config_metrics m WHERE m.config_id = c.id AND m.stage = 'post'
          AND m.headline = 1 AND m.task <> '') AS avg_acc,
       (SELECT m.value FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'params'
          AND m.stage = 'pre' AND m.task = '' ORDER BY m.metric_id LIMIT 1) AS params
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id;;
"""


def upgrade() -> None:
    conn = op.get_bind()
    drop_views(conn, VIEWS)
    op.add_column("configurations", sa.Column("output", sa.String(length=20), nullable=True))
    op.add_column("configurations", sa.Column("recovery", sa.String(length=50), nullable=True))
    execute_script(conn, VIEWS_SQL)


def downgrade() -> None:
    conn = op.get_bind()
    previous = importlib.import_module("db.migrations.versions.0002_identities_and_code")
    drop_views(conn, VIEWS)
    op.drop_column("configurations", "recovery")
    op.drop_column("configurations", "output")
    execute_script(conn, previous.VIEWS_SQL.split("-- config_code:")[0])
