"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# The views as this revision creates them: a frozen copy (a later change to a view is a new
# migration carrying its own SQL, never an edit here).
VIEWS = (
    "job_status",
    "curves",
    "layer_diagnostics",
    "selections",
    "task_scores",
    "results",
    "config_metrics",
)
VIEWS_SQL = """
-- Views that users and analysis read. Statements are separated by ';' at line end.
-- config_metrics: every metric attached to a configuration, either through the job that
-- produced it (our runs; jobs are shared by duplicate configurations) or directly (imported).
CREATE VIEW config_metrics AS
SELECT cj.config_id AS config_id, cj.stage AS job_stage, m.id AS metric_id, m.job_id AS job_id,
       m.name AS name, m.stage AS stage, m.task AS task, m.who AS who, m.step AS step,
       m.value AS value, m.value_kind AS value_kind, m.sum_nll AS sum_nll, m.n_tokens AS n_tokens,
       m.correct AS correct, m.total AS total, m.stderr AS stderr, m.num_fewshot AS num_fewshot,
       m.headline AS headline, m.extra_json AS extra_json
FROM config_jobs cj JOIN metrics m ON m.job_id = cj.job_id
UNION ALL
SELECT m.config_id, NULL, m.id, NULL, m.name, m.stage, m.task, m.who, m.step, m.value, m.value_kind,
       m.sum_nll, m.n_tokens, m.correct, m.total, m.stderr, m.num_fewshot, m.headline, m.extra_json
FROM metrics m WHERE m.config_id IS NOT NULL;

-- results: one row per configuration, its axes and headline numbers. Accuracies are fractions.
CREATE VIEW results AS
SELECT s.name AS sweep, s.kind AS sweep_kind, s.source AS source, c.id AS config_id,
       c.model AS model, c.teacher_variant AS teacher_variant, c.family AS family, c.kind AS kind,
       c.baseline AS baseline, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", c.top_k AS top_k, c.distill_loss AS distill_loss,
       c.teacher_top_k AS teacher_top_k, c.distill_tokens AS distill_tokens,
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

-- task_scores: per-task accuracies (fractions) with stderr, sample count and few-shot count.
CREATE VIEW task_scores AS
SELECT s.name AS sweep, c.id AS config_id, m.stage AS stage, m.task AS task, m.name AS metric,
       m.headline AS headline, m.value AS value, m.stderr AS stderr, m.total AS n,
       m.num_fewshot AS num_fewshot, m.extra_json AS extra_json
FROM config_metrics m JOIN configurations c ON c.id = m.config_id JOIN sweeps s ON s.id = c.sweep_id
WHERE m.task <> '' AND m.name IN ('acc', 'acc_norm');

-- selections: the conversion plan of every configuration, one row per layer and kept expert.
CREATE VIEW selections AS
SELECT s.name AS sweep, c.id AS config_id, c.model AS model, c.scoring AS scoring,
       c.grouping AS grouping, c.dp_scaling AS dp_scaling, c."K" AS "K", p.layer AS layer,
       p.expert AS expert, p.score AS score, p.selected_rank AS selected_rank,
       p.group_idx AS group_idx, p.merge_weight AS merge_weight, p.alpha AS alpha
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id
JOIN config_jobs cj ON cj.config_id = c.id AND cj.stage = 'convert'
JOIN plan_rows p ON p.job_id = cj.job_id;

-- layer_diagnostics: per-layer numbers of a conversion (effective rank of the kept kernel, ...).
CREATE VIEW layer_diagnostics AS
SELECT s.name AS sweep, c.id AS config_id, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", d.layer AS layer, d.name AS name, d.value AS value
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id
JOIN config_jobs cj ON cj.config_id = c.id AND cj.stage = 'convert'
JOIN layer_diag d ON d.job_id = cj.job_id;

-- curves: validation cross-entropy of student and teacher during distillation (Figure 5).
CREATE VIEW curves AS
SELECT s.name AS sweep, c.id AS config_id, c.scoring AS scoring, c.grouping AS grouping,
       c.dp_scaling AS dp_scaling, c."K" AS "K", c.model AS model, m.who AS who, m.step AS step,
       m.n_tokens AS tokens, m.value AS value
FROM config_metrics m JOIN configurations c ON c.id = m.config_id JOIN sweeps s ON s.id = c.sweep_id
WHERE m.name = 'val_ce';

-- job_status: how far each sweep is, per stage and status.
CREATE VIEW job_status AS
SELECT s.name AS sweep, j.stage AS stage, j.status AS status, COUNT(*) AS jobs
FROM sweeps s JOIN sweep_jobs sj ON sj.sweep_id = s.id JOIN jobs j ON j.id = sj.job_id
GROUP BY s.name, j.stage, j.status;
"""


def upgrade() -> None:
    # ### commands auto generated by Alembic - please adjust! ###
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("stage", sa.String(length=40), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(), nullable=True),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("duration_s", sa.Float(), nullable=True),
        sa.Column("compute_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("log_path", sa.Text(), nullable=True),
        sa.Column("code_version", sa.String(length=100), nullable=True),
        sa.Column("versions_json", sa.Text(), nullable=True),
        sa.Column("outputs_json", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_stage"), ["stage"], unique=False)
        batch_op.create_index(batch_op.f("ix_jobs_status"), ["status"], unique=False)

    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("spec_yaml", sa.Text(), nullable=True),
        sa.Column("spec_hash", sa.String(length=64), nullable=True),
        sa.Column("created_at", sa.DateTime(), server_default=sa.text("(CURRENT_TIMESTAMP)"), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "artifacts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=50), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=True),
        sa.Column("size_bytes", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "kind", "path"),
    )
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_artifacts_job_id"), ["job_id"], unique=False)

    op.create_table(
        "configurations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("config_key", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("teacher_variant", sa.String(length=50), nullable=True),
        sa.Column("family", sa.String(length=50), nullable=True),
        sa.Column("kind", sa.String(length=20), nullable=False),
        sa.Column("baseline", sa.String(length=200), nullable=True),
        sa.Column("scoring", sa.String(length=50), nullable=True),
        sa.Column("grouping", sa.String(length=50), nullable=True),
        sa.Column("dp_scaling", sa.String(length=50), nullable=True),
        sa.Column("K", sa.Integer(), nullable=True),
        sa.Column("top_k", sa.Integer(), nullable=True),
        sa.Column("distill_loss", sa.String(length=50), nullable=True),
        sa.Column("teacher_top_k", sa.Integer(), nullable=True),
        sa.Column("distill_tokens", sa.String(length=50), nullable=True),
        sa.Column("source_table", sa.String(length=50), nullable=True),
        sa.Column("selected_for_distill", sa.Integer(), nullable=False),
        sa.Column("duplicate_of", sa.Integer(), nullable=True),
        sa.Column("plan_key", sa.String(length=64), nullable=True),
        sa.Column("note", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["duplicate_of"],
            ["configurations.id"],
        ),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sweep_id", "config_key"),
    )
    with op.batch_alter_table("configurations", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_configurations_grouping"), ["grouping"], unique=False)
        batch_op.create_index(batch_op.f("ix_configurations_scoring"), ["scoring"], unique=False)
        batch_op.create_index(batch_op.f("ix_configurations_sweep_id"), ["sweep_id"], unique=False)

    op.create_table(
        "layer_diag",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=50), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "layer", "name"),
    )
    with op.batch_alter_table("layer_diag", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_layer_diag_job_id"), ["job_id"], unique=False)

    op.create_table(
        "plan_rows",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("layer", sa.Integer(), nullable=False),
        sa.Column("expert", sa.Integer(), nullable=False),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("selected_rank", sa.Integer(), nullable=False),
        sa.Column("group_idx", sa.Integer(), nullable=False),
        sa.Column("merge_weight", sa.Float(), nullable=False),
        sa.Column("alpha", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "layer", "expert"),
    )
    with op.batch_alter_table("plan_rows", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_plan_rows_job_id"), ["job_id"], unique=False)

    op.create_table(
        "sweep_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("sweep_id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["sweep_id"], ["sweeps.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("sweep_id", "job_id"),
    )
    with op.batch_alter_table("sweep_jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_sweep_jobs_job_id"), ["job_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_sweep_jobs_sweep_id"), ["sweep_id"], unique=False)

    op.create_table(
        "config_jobs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("config_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(["config_id"], ["configurations.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("config_id", "stage"),
    )
    with op.batch_alter_table("config_jobs", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_config_jobs_config_id"), ["config_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_config_jobs_job_id"), ["job_id"], unique=False)

    op.create_table(
        "metrics",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("config_id", sa.Integer(), nullable=True),
        sa.Column("name", sa.String(length=50), nullable=False),
        sa.Column("stage", sa.String(length=20), nullable=False),
        sa.Column("task", sa.String(length=100), nullable=False),
        sa.Column("who", sa.String(length=20), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=True),
        sa.Column("value_kind", sa.String(length=10), nullable=False),
        sa.Column("sum_nll", sa.Float(), nullable=True),
        sa.Column("n_tokens", sa.Integer(), nullable=True),
        sa.Column("correct", sa.Float(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=True),
        sa.Column("stderr", sa.Float(), nullable=True),
        sa.Column("num_fewshot", sa.Integer(), nullable=True),
        sa.Column("headline", sa.Integer(), nullable=False),
        sa.Column("extra_json", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(["config_id"], ["configurations.id"], ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_metrics_job_id"), ["job_id"], unique=False)
        batch_op.create_index(
            "uq_metric_config",
            ["config_id", "name", "stage", "task", "who", "step"],
            unique=True,
            sqlite_where=sa.text("config_id IS NOT NULL"),
            postgresql_where=sa.text("config_id IS NOT NULL"),
        )
        batch_op.create_index(
            "uq_metric_job",
            ["job_id", "name", "stage", "task", "who", "step"],
            unique=True,
            sqlite_where=sa.text("job_id IS NOT NULL"),
            postgresql_where=sa.text("job_id IS NOT NULL"),
        )

    # ### end Alembic commands ###
    execute_script(op.get_bind(), VIEWS_SQL)


def downgrade() -> None:
    drop_views(op.get_bind(), VIEWS)
    # ### commands auto generated by Alembic - please adjust! ###
    with op.batch_alter_table("metrics", schema=None) as batch_op:
        batch_op.drop_index(
            "uq_metric_job",
            sqlite_where=sa.text("job_id IS NOT NULL"),
            postgresql_where=sa.text("job_id IS NOT NULL"),
        )
        batch_op.drop_index(
            "uq_metric_config",
            sqlite_where=sa.text("config_id IS NOT NULL"),
            postgresql_where=sa.text("config_id IS NOT NULL"),
        )
        batch_op.drop_index(batch_op.f("ix_metrics_job_id"))

    op.drop_table("metrics")
    with op.batch_alter_table("config_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_config_jobs_job_id"))
        batch_op.drop_index(batch_op.f("ix_config_jobs_config_id"))

    op.drop_table("config_jobs")
    with op.batch_alter_table("sweep_jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_sweep_jobs_sweep_id"))
        batch_op.drop_index(batch_op.f("ix_sweep_jobs_job_id"))

    op.drop_table("sweep_jobs")
    with op.batch_alter_table("plan_rows", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_plan_rows_job_id"))

    op.drop_table("plan_rows")
    with op.batch_alter_table("layer_diag", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_layer_diag_job_id"))

    op.drop_table("layer_diag")
    with op.batch_alter_table("configurations", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_configurations_sweep_id"))
        batch_op.drop_index(batch_op.f("ix_configurations_scoring"))
        batch_op.drop_index(batch_op.f("ix_configurations_grouping"))

    op.drop_table("configurations")
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_artifacts_job_id"))

    op.drop_table("artifacts")
    op.drop_table("sweeps")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_status"))
        batch_op.drop_index(batch_op.f("ix_jobs_stage"))

    op.drop_table("jobs")
    # ### end Alembic commands ###
