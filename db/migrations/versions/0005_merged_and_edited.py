"""merged and edited smaller MoEs: configurations.merging, .editing, .settings; results shows them

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

Two more axes of the grid become columns: `merging` (the method that merged a `merged` output's experts:
HC-SMoE, M-SMoE) and `editing` (the method that factorised an `edited` output's experts: MoBE, TD-MoE).
`settings` is the JSON of the settings a configuration's output and method were given (a method is keyed
by its implementation and its settings, not by its name alone). `recovery` may now be `full_kd`.
Like every revision it carries its own copy of the view SQL it creates.
"""

import importlib

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

VIEWS = ("results",)  # created here (dropped first on downgrade)
VIEWS_SQL = """
-- results: one row per configuration, its axes and headline numbers. Accuracies are fractions.
-- output: dense | moe | merged | edited; scoring / merging / editing: the method that made it;
-- recovery: none | router_kd | full_kd (smaller MoEs); settings: its methods' settings (JSON);
-- params: the student's measured size.
CREATE VIEW results AS
SELECT s.name AS sweep, s.kind AS sweep_kind, s.source AS source, c.id AS config_id,
       c.config_key AS config_key, c.model AS model, c.teacher_variant AS teacher_variant, c.family AS family, c.kind AS kind,
       c.baseline AS baseline, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", c.output AS output, c.recovery AS recovery,
       c.merging AS merging, c.editing AS editing, c.settings AS settings,
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
    op.add_column("configurations", sa.Column("merging", sa.String(length=50), nullable=True))
    op.add_column("configurations", sa.Column("editing", sa.String(length=50), nullable=True))
    op.add_column("configurations", sa.Column("settings", sa.Text(), nullable=True))
    execute_script(conn, VIEWS_SQL)


def downgrade() -> None:
    conn = op.get_bind()
    previous = importlib.import_module("db.migrations.versions.0004_output_and_recovery")
    drop_views(conn, VIEWS)
    op.drop_column("configurations", "settings")
    op.drop_column("configurations", "editing")
    op.drop_column("configurations", "merging")
    execute_script(conn, previous.VIEWS_SQL)
