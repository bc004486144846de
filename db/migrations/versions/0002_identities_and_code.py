"""identities and code: jobs.code_json, configurations.variant/variant_of, sweeps.select_json

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

Adds the columns that store what analysis used to guess, and recreates the `results` view with
them; adds the views `config_code` (the code that computed each configuration's numbers) and
`sweep_info` (each sweep's kind, source and stored selection rule). Like every revision it carries
its own copy of the view SQL it creates: a later change to a view is a new migration.
"""

import importlib

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

FK_VARIANT_OF = "fk_configurations_variant_of_configurations"
VIEWS = ("sweep_info", "config_code", "results")  # created here (dropped first on downgrade)
VIEWS_SQL = """
-- results: one row per configuration, its axes and headline numbers. Accuracies are fractions.
-- variant / variant_of: the label of a distillation variant and the main configuration it varies.
CREATE VIEW results AS
SELECT s.name AS sweep, s.kind AS sweep_kind, s.source AS source, c.id AS config_id,
       c.model AS model, c.teacher_variant AS teacher_variant, c.family AS family, c.kind AS kind,
       c.baseline AS baseline, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", c.top_k AS top_k, c.distill_loss AS distill_loss,
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
          AND m.headline = 1 AND m.task <> '') AS avg_acc
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id;

-- config_code: per configuration and stage, the job that produced its numbers and the code that
-- computed it (code_version: a short hash of all components; code_json: {component: hash}).
CREATE VIEW config_code AS
SELECT s.name AS sweep, c.id AS config_id, cj.stage AS stage, j.id AS job_id, j.key AS job_key,
       j.code_version AS code_version, j.code_json AS code_json
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id
JOIN config_jobs cj ON cj.config_id = c.id
JOIN jobs j ON j.id = cj.job_id;

-- sweep_info: one row per sweep, what it is and its selection rule
-- (select_json: {"best_by": ..., "per": [...], "over": [...]}; NULL: none stored).
CREATE VIEW sweep_info AS
SELECT s.name AS sweep, s.kind AS kind, s.source AS source, s.description AS description,
       s.spec_hash AS spec_hash, s.select_json AS select_json, s.created_at AS created_at,
       s.updated_at AS updated_at
FROM sweeps s;
"""


def upgrade() -> None:
    conn = op.get_bind()
    drop_views(conn, ("results",))
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("code_json", sa.Text(), nullable=True))
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.add_column(sa.Column("select_json", sa.Text(), nullable=True))
    with op.batch_alter_table("configurations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("variant", sa.String(length=200), nullable=True))
    if conn.dialect.name == "sqlite":
        # SQLite adds a column with an inline REFERENCES in place; a batch copy of the table would
        # drop the old one, and with foreign keys on that cascades into metrics and config_jobs
        conn.exec_driver_sql(
            "ALTER TABLE configurations ADD COLUMN variant_of INTEGER REFERENCES configurations (id)"
        )
    else:
        op.add_column("configurations", sa.Column("variant_of", sa.Integer(), nullable=True))
        op.create_foreign_key(FK_VARIANT_OF, "configurations", "configurations", ["variant_of"], ["id"])
    execute_script(conn, VIEWS_SQL)


def downgrade() -> None:
    conn = op.get_bind()
    if conn.dialect.name == "sqlite" and conn.exec_driver_sql("PRAGMA foreign_keys").scalar():
        raise RuntimeError(
            "downgrade 0002 on SQLite copies tables and needs PRAGMA foreign_keys=OFF "
            "(with it on, the copy would cascade-delete rows); run it with the alembic CLI"
        )
    previous = importlib.import_module("db.migrations.versions.0001_initial_schema")
    drop_views(conn, VIEWS + previous.VIEWS)  # SQLite's table copies fail while a view names the table
    if conn.dialect.name != "sqlite":
        op.drop_constraint(FK_VARIANT_OF, "configurations", type_="foreignkey")
    with op.batch_alter_table("configurations", schema=None) as batch_op:
        batch_op.drop_column("variant_of")
        batch_op.drop_column("variant")
    with op.batch_alter_table("sweeps", schema=None) as batch_op:
        batch_op.drop_column("select_json")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("code_json")
    execute_script(conn, previous.VIEWS_SQL)
