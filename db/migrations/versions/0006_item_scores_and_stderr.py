"""per-item scores: table item_scores, view config_items; results gains standard errors and n

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24

`item_scores` keeps, per evaluation job, the per-item scores behind its metrics (db/items.py packs
them): lm-eval's per-sample metrics and choice log-likelihoods keyed by doc_id, and a perplexity's
per-window Σ NLL and scored tokens, so any comparison can be recomputed and paired over the same items.
`config_items` attaches them to configurations (through config_jobs, as config_metrics does).
`results` gains each number's standard error and n: ppl_pre_se / ppl_pre_n and ppl_post_se /
ppl_post_n (n = scored windows, the units of the SE; ppl_pre_tokens stays the token count) and
avg_acc_se / avg_acc_n (the SE of the mean of the headline task accuracies, tasks independent:
√(Σ se_t²) / T; n = the items of those tasks together).
Like every revision it carries its own copy of the view SQL it creates.
"""

import importlib

import sqlalchemy as sa
from alembic import op

from db.views import drop_views, execute_script

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

VIEWS = ("results", "config_items")  # created here (dropped first on downgrade)
VIEWS_SQL = """
-- results: one row per configuration, its axes and headline numbers. Accuracies are fractions.
-- output: dense | moe | merged | edited; scoring / merging / editing: the method that made it;
-- recovery: none | router_kd | full_kd (smaller MoEs); settings: its methods' settings (JSON);
-- params: the student's measured size. *_se: standard errors from the per-item scores; ppl_*_n: scored
-- windows; avg_acc_se: sqrt(sum of the headline tasks' se^2) / tasks; avg_acc_n: their items together.
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
       (SELECT m.stderr FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre_se,
       (SELECT m.total FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'pre' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_pre_n,
       (SELECT m.value FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post,
       (SELECT m.value_kind FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post_kind,
       (SELECT m.stderr FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post_se,
       (SELECT m.total FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'ppl'
          AND m.stage = 'post' AND m.task = '' AND m.who IN ('', 'student') ORDER BY m.metric_id LIMIT 1) AS ppl_post_n,
       (SELECT AVG(m.value) FROM config_metrics m WHERE m.config_id = c.id AND m.stage = 'post'
          AND m.headline = 1 AND m.task <> '') AS avg_acc,
       (SELECT CASE WHEN COUNT(m.stderr) = COUNT(*) AND COUNT(*) > 0
                    THEN SQRT(SUM(m.stderr * m.stderr)) / COUNT(*) END
          FROM config_metrics m WHERE m.config_id = c.id AND m.stage = 'post'
          AND m.headline = 1 AND m.task <> '') AS avg_acc_se,
       (SELECT SUM(m.total) FROM config_metrics m WHERE m.config_id = c.id AND m.stage = 'post'
          AND m.headline = 1 AND m.task <> '') AS avg_acc_n,
       (SELECT m.value FROM config_metrics m WHERE m.config_id = c.id AND m.name = 'params'
          AND m.stage = 'pre' AND m.task = '' ORDER BY m.metric_id LIMIT 1) AS params
FROM configurations c JOIN sweeps s ON s.id = c.sweep_id;

-- config_items: the per-item scores (item_scores) of every configuration's jobs; ids and vals are
-- zlib-compressed little-endian arrays (int64 doc_id or window index; float64 values), see db/items.py.
CREATE VIEW config_items AS
SELECT cj.config_id AS config_id, cj.stage AS job_stage, i.job_id AS job_id, i.id AS item_id,
       i.stage AS stage, i.task AS task, i.subtask AS subtask, i.step AS step, i.name AS name, i.n AS n,
       i.ids AS ids, i.vals AS vals
FROM config_jobs cj JOIN item_scores i ON i.job_id = cj.job_id;
"""


def upgrade() -> None:
    conn = op.get_bind()
    drop_views(conn, VIEWS)
    op.create_table(
        "item_scores",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("stage", sa.String(length=20), nullable=False),
        sa.Column("task", sa.String(length=100), nullable=False),
        sa.Column("subtask", sa.String(length=200), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=50), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("ids", sa.LargeBinary(), nullable=False),
        sa.Column("vals", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("job_id", "stage", "task", "subtask", "step", "name"),
    )
    op.create_index(op.f("ix_item_scores_job_id"), "item_scores", ["job_id"], unique=False)
    execute_script(conn, VIEWS_SQL)


def downgrade() -> None:
    conn = op.get_bind()
    previous = importlib.import_module("db.migrations.versions.0005_merged_and_edited")
    drop_views(conn, VIEWS)
    op.drop_index(op.f("ix_item_scores_job_id"), table_name="item_scores")
    op.drop_table("item_scores")
    execute_script(conn, previous.VIEWS_SQL)
