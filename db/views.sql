-- Views that users and analysis read (DESIGN.md §4). Statements are separated by ';' at line end.
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
