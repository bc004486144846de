"""Read the database's views into pandas frames (analysis never reads worker outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
from sqlalchemy import bindparam, text
from sqlalchemy.engine import Engine

from db.items import unpack_ids, unpack_values

FLOAT_COLUMNS = (
    "ppl_pre",
    "ppl_post",
    "avg_acc",
    "ppl_pre_sum_nll",
    "value",
    "score",
    "merge_weight",
    "alpha",
    "stderr",
)
INT_COLUMNS = (
    "config_id",
    "K",
    "top_k",
    "teacher_top_k",
    "selected_for_distill",
    "duplicate_of",
    "variant_of",
    "job_id",
    "layer",
    "expert",
    "step",
    "tokens",
    "selected_rank",
    "group_idx",
    "n",
    "num_fewshot",
    "headline",
)
# published numbers kept beside the computed ones (analysis/reference.py)
PUBLISHED = {"ppl_published": "ppl_pre_published", "avg_published": "avg_published"}


@dataclass(frozen=True)
class Frames:
    """Everything a report needs about some sweeps, one frame per view."""

    sweeps: tuple[str, ...]
    # the `results` view + published columns + `avg` + the sweep's `select_json`, one row per configuration
    results: pd.DataFrame
    tasks: pd.DataFrame  # `task_scores` (post-distillation accuracies, fractions)
    selections: pd.DataFrame  # `selections` (kept experts per layer)
    # `layer_diagnostics`, per layer and name: `effective_rank` (of the kept experts' kernel 𝒦_S with the
    # scoring's own base score), `effective_rank_acp`, and for the D-optimal scorings `lambda` and `log_det`.
    # `log_det` is the normalised objective F̃(S) = log det(I + 𝒦_S/λ) that the greedy maximises (the
    # paper's Eq. 11), not Eq. 4's value log det(𝒦_S + λI); the two differ by K·log λ
    diagnostics: pd.DataFrame
    curves: pd.DataFrame  # `curves` (validation CE during distillation)
    info: pd.DataFrame  # `sweep_info`, one row per sweep: kind, source, stored selection rule (select_json)
    code: pd.DataFrame  # `config_code`: per configuration and stage, the job and its code (code_json)
    # `config_items` (per-item scores: headline metrics by doc_id, perplexity windows' nll / tokens), `ids`
    # and `vals` unpacked to numpy arrays; empty for sweeps without them (imported papers, older runs)
    items: pd.DataFrame = field(default_factory=pd.DataFrame)
    # the metrics of dense → MoE configurations (kind dense2moe): `ppl` of stage dot_moe per evaluated top-k
    # (`step`; who student) and of the dense model (who dense)
    dense2moe: pd.DataFrame = field(default_factory=pd.DataFrame)


def _read(engine: Engine, sql: str, names: list[str]) -> pd.DataFrame:
    stmt = text(sql).bindparams(bindparam("names", expanding=True))
    with engine.connect() as c:
        res = c.execute(stmt, {"names": names})
        df = pd.DataFrame(res.fetchall(), columns=list(res.keys()))
    for col in df.columns:
        if col in INT_COLUMNS or col == "ppl_pre_tokens":
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("Int64")
        elif col in FLOAT_COLUMNS:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        else:  # text: missing is None, never NaN, so rows compare and group plainly
            df[col] = df[col].astype(object).where(df[col].notna(), None)
    return df


def load_frames(engine: Engine, sweeps: list[str]) -> Frames:
    """The views' rows for `sweeps`, in a stable order (same DB → same frames)."""
    names = list(dict.fromkeys(sweeps))
    if not names:
        raise ValueError("sweeps: empty; allowed: one or more sweep names")
    results = _read(engine, "SELECT * FROM results WHERE sweep IN :names ORDER BY sweep, config_id", names)
    pub = _read(
        engine,
        "SELECT m.config_id AS config_id, m.name AS name, m.value AS value FROM config_metrics m "
        "WHERE m.name IN ('ppl_published', 'avg_published') AND m.config_id IN "
        "(SELECT r.config_id FROM results r WHERE r.sweep IN :names) "
        "ORDER BY m.config_id, m.metric_id",
        names,
    )
    for metric, col in PUBLISHED.items():
        vals = pub[pub["name"] == metric].drop_duplicates("config_id").set_index("config_id")["value"]
        results[col] = results["config_id"].map(vals).astype(float)
    # the accuracy analysis uses: a paper's own average where it gives one (its tasks are printed
    # rounded, its average is not), else the mean of the headline tasks (`results.avg_acc`)
    results["avg"] = results["avg_published"].where(results["avg_published"].notna(), results["avg_acc"])
    info = _read(engine, "SELECT * FROM sweep_info WHERE sweep IN :names ORDER BY sweep", names)
    rules = dict(zip(info["sweep"], info["select_json"], strict=True))
    results["select_json"] = [rules.get(sw) for sw in results["sweep"]]
    tasks = _read(
        engine,
        "SELECT * FROM task_scores WHERE sweep IN :names ORDER BY sweep, config_id, task, metric",
        names,
    )
    selections = _read(
        engine,
        "SELECT * FROM selections WHERE sweep IN :names ORDER BY sweep, config_id, layer, selected_rank",
        names,
    )
    diagnostics = _read(
        engine,
        "SELECT * FROM layer_diagnostics WHERE sweep IN :names ORDER BY sweep, config_id, name, layer",
        names,
    )
    curves = _read(
        engine, "SELECT * FROM curves WHERE sweep IN :names ORDER BY sweep, config_id, who, step", names
    )
    code = _read(
        engine, "SELECT * FROM config_code WHERE sweep IN :names ORDER BY sweep, config_id, stage", names
    )
    dense2moe = _read(
        engine,
        "SELECT m.config_id AS config_id, m.name AS name, m.stage AS stage, m.who AS who, m.step AS step, "
        "m.value AS value FROM config_metrics m WHERE m.stage = 'dot_moe' AND m.config_id IN "
        "(SELECT r.config_id FROM results r WHERE r.sweep IN :names AND r.kind = 'dense2moe') "
        "ORDER BY m.config_id, m.metric_id",
        names,
    )
    return Frames(
        tuple(names),
        results,
        tasks,
        selections,
        diagnostics,
        curves,
        info,
        code,
        load_items(engine, names),
        dense2moe,
    )


def load_items(engine: Engine, sweeps: list[str]) -> pd.DataFrame:
    """The per-item scores a comparison needs (headline metrics and perplexity windows; not the choices'
    log-likelihoods), arrays unpacked; one row per configuration, stage, task, leaf task, step and name."""
    items = _read(
        engine,
        "SELECT i.config_id AS config_id, i.stage AS stage, i.task AS task, i.subtask AS subtask, "
        "i.step AS step, i.name AS name, i.n AS n, i.ids AS ids, i.vals AS vals FROM config_items i "
        "WHERE i.name <> 'loglik' AND i.config_id IN (SELECT r.config_id FROM results r WHERE r.sweep IN :names) "
        "ORDER BY i.config_id, i.stage, i.task, i.subtask, i.step, i.name, i.item_id",
        sweeps,
    )
    items["ids"] = [unpack_ids(b) for b in items["ids"]]
    items["vals"] = [unpack_values(b) for b in items["vals"]]
    return items
