"""What the dashboard shows, read through a read-only `Store`.

Every query here is a constant SQL text; values a visitor sends (a sweep name, a filter, a job key) are
bound parameters, never spliced into the text. Column names that a visitor chooses (the sort column, the
filter axes) are looked up in fixed lists first, so the SQL text only ever holds names written here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from db import axes
from db.store import Store, owner_dead

STATUSES = ("succeeded", "running", "failed", "pending")
# the results table: the columns shown, those a visitor may filter on (axes) and sort by; the axes come
# from db/axes.py in its reading order, with the configuration's description around them
DESCRIBED_BY = ("model", "kind", "baseline")  # before the axes
VARIED_BY = ("variant", "distill_loss", "teacher_top_k")  # after them: what a distillation variant changes
NUMBERS = (
    "ppl_pre",
    "ppl_pre_kind",
    "ppl_pre_se",
    "ppl_pre_n",
    "ppl_post",
    "ppl_post_kind",
    "ppl_post_se",
    "ppl_post_n",
    "avg_acc",
    "avg_acc_se",
    "avg_acc_n",
    "params",
)
# the numbers of the results page (and its CSV), each with its standard error and n where it has them
MEASURES = ("ppl_pre", "ppl_post", "avg_acc")
MAX_COMPARED = 8  # configurations side by side on the compare page


def result_columns() -> tuple[str, ...]:
    return (
        "config_id",
        "config_key",
        *DESCRIBED_BY,
        *axes.listed(),
        "top_k",
        *VARIED_BY,
        "distill_tokens",
        *NUMBERS,
        "selected_for_distill",
        "duplicate_of",
    )


def filter_axes() -> tuple[str, ...]:
    return (*DESCRIBED_BY, *axes.listed(), *VARIED_BY)


def csv_columns(shown_axes: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The columns of a results CSV: the results page's (id and key, the axes it shows, the numbers with
    their SE and n, the pick and the duplicate), named as the database names them."""
    numbers = [c for c in NUMBERS if not c.endswith("_kind")]
    return ("config_id", "config_key", *shown_axes, *numbers, "selected_for_distill", "duplicate_of")


def table_axes() -> tuple[str, ...]:
    """The columns of the results page between the id and the numbers (shown where a row has a value)."""
    return tuple(a for a in filter_axes() if a != "model")


def config_page_fields() -> tuple[str, ...]:
    """What a configuration's page lists (each where it has a value)."""
    return (
        *DESCRIBED_BY,
        *axes.listed(),
        "top_k",
        "settings",
        *VARIED_BY,
        "distill_tokens",
        "duplicate_of",
        "variant_of",
        "plan_key",
    )


def labels() -> dict[str, str]:
    """Column → its title (the axes' labels; any other column is titled by its name)."""
    return axes.labels()


RESULT_COLUMNS = result_columns()
FILTER_AXES = filter_axes()
TABLE_AXES = table_axes()
CONFIG_PAGE_FIELDS = config_page_fields()
LABELS = labels()
INT_AXES = axes.int_axes() | {"teacher_top_k", "top_k"}
SORTABLE = frozenset(RESULT_COLUMNS) - {"ppl_pre_kind", "ppl_post_kind"}


class BadRequest(ValueError):
    """A query parameter that cannot be used (one line, shown to the visitor as a 400)."""


INT_MAX = 2**31 - 1  # the integer axes are counts (K, top-k): anything above cannot be in the database


def shown(value: str, limit: int = 40) -> str:
    """A visitor's value quoted for a one-line message, cut to `limit` characters."""
    return repr(value if len(value) <= limit else value[:limit] + "…")


def _q(name: str) -> str:
    """A column name from the fixed lists above, quoted (`K` is upper case)."""
    assert name in RESULT_COLUMNS, name
    return f'"{name}"'


def rows(store: Store, sql: str, params: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    cols, found = store.query(sql, params or {})
    return [dict(zip(cols, r, strict=True)) for r in found]


def stage_order(store: Store) -> list[str]:
    """The stages in launch order, read from the database (the order the orchestrator recorded, then
    as the jobs first name them): the dashboard never imports the orchestrator."""
    return store.stage_order()


def _ordered(stage_names, order: list[str]) -> list[str]:
    return sorted(set(stage_names), key=lambda s: (order.index(s) if s in order else len(order), s))


# ---- sweeps ---------------------------------------------------------------------------------------
@dataclass
class SweepRow:
    name: str
    kind: str
    source: str
    description: str
    configs: int
    selected: int
    updated_at: Any
    counts: dict[str, dict[str, int]]  # stage -> status -> jobs

    @property
    def total(self) -> dict[str, int]:
        out = dict.fromkeys(STATUSES, 0)
        for per in self.counts.values():
            for st, n in per.items():
                out[st] = out.get(st, 0) + n
        return out

    @property
    def status(self) -> str:
        """reference | not started | running | failed | pending | finished (a launch's state at a glance)."""
        if self.kind == "reference":
            return "reference"
        t = self.total
        if not sum(t.values()):
            return "not started"
        if t["running"]:
            return "running"
        if t["failed"]:
            return "failed"
        if t["pending"]:
            return "pending"
        return "finished"


def stage_counts(store: Store, sweep: str | None = None) -> dict[str, dict[str, dict[str, int]]]:
    """{sweep: {stage: {status: jobs}}} (stages in launch order); a running job whose launch is gone
    counts as `dead`, as `moesweep status` shows it."""
    where, params = ("WHERE s.name = :sweep", {"sweep": sweep}) if sweep is not None else ("", {})
    found = rows(
        store,
        "SELECT s.name AS sweep, j.stage AS stage, j.status AS status, j.owner AS owner, "
        "j.heartbeat_at AS heartbeat_at FROM sweeps s JOIN sweep_jobs sj ON sj.sweep_id = s.id "
        f"JOIN jobs j ON j.id = sj.job_id {where}",
        params,
    )
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in found:
        st = r["status"]
        if st == "running" and owner_dead(r["owner"], r["heartbeat_at"]):
            st = "dead"
        per = out.setdefault(r["sweep"], {}).setdefault(r["stage"], {})
        per[st] = per.get(st, 0) + 1
    order = stage_order(store)
    return {sw: {stage: per[stage] for stage in _ordered(per, order)} for sw, per in out.items()}


def sweeps(store: Store) -> list[SweepRow]:
    """Every sweep in the database, launched ones first, with its progress per stage."""
    counts = stage_counts(store)
    found = rows(
        store,
        "SELECT s.name AS name, s.kind AS kind, s.source AS source, s.description AS "
        "description, s.updated_at AS updated_at, "
        "(SELECT COUNT(*) FROM configurations c WHERE c.sweep_id = s.id) AS configs, "
        "(SELECT COUNT(*) FROM configurations c WHERE c.sweep_id = s.id "
        "AND c.selected_for_distill = 1) AS selected "
        "FROM sweeps s ORDER BY CASE WHEN s.kind = 'reference' THEN 1 ELSE 0 END, s.name",
    )
    return [
        SweepRow(
            r["name"],
            r["kind"],
            r["source"] or "",
            r["description"] or "",
            r["configs"] or 0,
            r["selected"] or 0,
            r["updated_at"],
            counts.get(r["name"], {}),
        )
        for r in found
    ]


def sweep(store: Store, name: str) -> SweepRow | None:
    return next((s for s in sweeps(store) if s.name == name), None)


# ---- results --------------------------------------------------------------------------------------
def _axis_value(axis: str, value: str) -> Any:
    if axis in INT_AXES:
        try:
            v = int(value)
        except ValueError:
            raise BadRequest(f"{axis}: {shown(value)} is not an integer") from None
        if not 0 <= v <= INT_MAX:
            raise BadRequest(f"{axis}: {shown(value)} is out of range; allowed: 0 to {INT_MAX}")
        return v
    return value


def filter_options(store: Store, name: str) -> dict[str, list[Any]]:
    """Per filterable axis, the values it takes in the sweep (axes with a single value or none are left out)."""
    found = rows(
        store,
        "SELECT " + ", ".join(_q(a) for a in FILTER_AXES) + " FROM results WHERE sweep = :sweep",
        {"sweep": name},
    )
    out = {}
    for a in FILTER_AXES:
        vals = sorted({r[a] for r in found if r[a] is not None}, key=lambda v: (str(type(v)), v))
        if len(vals) > 1 or (vals and any(r[a] is None for r in found)):
            out[a] = vals
    return out


def results(
    store: Store,
    name: str,
    filters: dict[str, str],
    sort: str | None = None,
    desc: bool = False,
    selected_only: bool = False,
    search: str | None = None,
) -> list[dict[str, Any]]:
    """The sweep's configurations, filtered by axis values (bound), sorted by a known column."""
    if sort is not None and sort not in SORTABLE:
        raise BadRequest(f"sort: unknown column {sort!r}; allowed: {', '.join(sorted(SORTABLE))}")
    where, params = ["sweep = :sweep"], {"sweep": name}
    for i, (axis, value) in enumerate(sorted(filters.items())):
        if axis not in FILTER_AXES:
            raise BadRequest(f"unknown filter {axis!r}; allowed: {', '.join(FILTER_AXES)}")
        where.append(f"{_q(axis)} = :f{i}")
        params[f"f{i}"] = _axis_value(axis, value)
    if selected_only:
        where.append("selected_for_distill = 1")
    if search:
        where.append("config_key LIKE :search")
        params["search"] = f"%{search}%"
    order = "config_id"
    if sort is not None:
        col = _q(sort)
        order = f"CASE WHEN {col} IS NULL THEN 1 ELSE 0 END, {col} {'DESC' if desc else 'ASC'}, config_id"
    return rows(
        store,
        f"SELECT {', '.join(_q(c) for c in RESULT_COLUMNS)} FROM results WHERE "
        f"{' AND '.join(where)} ORDER BY {order}",
        params,
    )


# ---- one configuration ----------------------------------------------------------------------------
def config(store: Store, config_id: int) -> dict[str, Any] | None:
    found = rows(store, "SELECT * FROM results WHERE config_id = :c", {"c": config_id})
    return found[0] if found else None


def _id_list(ids: list[int]) -> tuple[str, dict[str, int]]:
    """`:c0, :c1, …` and their bound values (at most MAX_COMPARED ids: the SQL text names no value)."""
    assert 0 < len(ids) <= MAX_COMPARED, ids
    params = {f"c{i}": int(c) for i, c in enumerate(ids)}
    return ", ".join(f":{k}" for k in params), params


def configs(store: Store, ids: list[int]) -> dict[int, dict[str, Any]]:
    """The `results` rows of some configurations (of any sweeps: ids are global), by id."""
    marks, params = _id_list(ids)
    found = rows(store, f"SELECT * FROM results WHERE config_id IN ({marks})", params)
    return {r["config_id"]: r for r in found}


def task_scores(store: Store, ids: list[int]) -> list[dict[str, Any]]:
    """Per configuration its per-task accuracies (fractions) with stderr and n (items), every stage."""
    marks, params = _id_list(ids)
    return rows(
        store,
        "SELECT config_id, stage, task, metric, headline, value, stderr, n, num_fewshot FROM task_scores "
        f"WHERE config_id IN ({marks}) ORDER BY task, metric, stage, config_id",
        params,
    )


def plan(store: Store, config_id: int) -> list[dict[str, Any]]:
    """Per layer and group, the kept experts with their merge weights and α (the conversion plan)."""
    found = rows(
        store,
        "SELECT layer, expert, score, selected_rank, group_idx, merge_weight, alpha "
        "FROM selections WHERE config_id = :c ORDER BY layer, group_idx, selected_rank",
        {"c": config_id},
    )
    layers: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for r in found:
        layers.setdefault(r["layer"], {}).setdefault(r["group_idx"], []).append(r)
    return [
        {
            "layer": layer,
            "kept": sum(len(g) for g in groups.values()),
            "groups": [{"group": g, "experts": ex} for g, ex in sorted(groups.items())],
        }
        for layer, groups in sorted(layers.items())
    ]


def metrics(store: Store, config_id: int) -> list[dict[str, Any]]:
    """Every metric of the configuration with its n (tokens for a perplexity or loss, items for a task)."""
    found = rows(
        store,
        "SELECT job_stage, name, stage, task, who, step, value, value_kind, n_tokens, total, "
        "correct, stderr, num_fewshot, headline FROM config_metrics WHERE config_id = :c "
        "ORDER BY name, stage, task, who, step, metric_id",
        {"c": config_id},
    )
    for r in found:
        r["n"] = r["total"] if r["total"] is not None else r["n_tokens"]
    return found


def curve(store: Store, config_id: int) -> dict[str, list[tuple[int, float]]]:
    """Validation CE during distillation: {who: [(step, value)]}."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows(
        store,
        "SELECT who, step, value FROM curves WHERE config_id = :c AND value IS NOT NULL ORDER BY who, step",
        {"c": config_id},
    ):
        out.setdefault(r["who"] or "student", []).append((r["step"], r["value"]))
    return out


def config_jobs(store: Store, config_id: int) -> list[dict[str, Any]]:
    found = rows(
        store,
        "SELECT cj.stage AS stage, j.key AS key, j.status AS status, j.attempts AS attempts, "
        "j.started_at AS started_at, j.finished_at AS finished_at, j.duration_s AS duration_s, "
        "j.error AS error, j.log_path AS log_path FROM config_jobs cj "
        "JOIN jobs j ON j.id = cj.job_id WHERE cj.config_id = :c",
        {"c": config_id},
    )
    order = stage_order(store)
    return sorted(found, key=lambda r: order.index(r["stage"]) if r["stage"] in order else len(order))


# ---- jobs -----------------------------------------------------------------------------------------
def sweep_jobs(
    store: Store, name: str, stage: str | None = None, status: str | None = None
) -> list[dict[str, Any]]:
    where, params = ["s.name = :sweep"], {"sweep": name}
    if stage:
        where.append("j.stage = :stage")
        params["stage"] = stage
    if status:
        where.append("j.status = :status")
        params["status"] = status
    found = rows(
        store,
        "SELECT j.key AS key, j.stage AS stage, j.status AS status, j.attempts AS attempts, "
        "j.started_at AS started_at, j.finished_at AS finished_at, j.duration_s AS duration_s, "
        "j.error AS error FROM sweeps s JOIN sweep_jobs sj ON sj.sweep_id = s.id "
        f"JOIN jobs j ON j.id = sj.job_id WHERE {' AND '.join(where)} ORDER BY j.id",
        params,
    )
    order = stage_order(store)
    return sorted(found, key=lambda r: order.index(r["stage"]) if r["stage"] in order else len(order))


def job(store: Store, key: str) -> dict[str, Any] | None:
    found = rows(store, "SELECT * FROM jobs WHERE key = :k", {"k": key})
    if not found:
        return None
    j = found[0]
    j["params"] = json.loads(j["params_json"] or "{}")
    j["configs"] = rows(
        store,
        "SELECT c.id AS config_id, c.config_key AS config_key, s.name AS sweep, "
        "cj.stage AS stage FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
        "JOIN sweeps s ON s.id = c.sweep_id WHERE cj.job_id = :j ORDER BY c.id",
        {"j": j["id"]},
    )
    j["sweeps"] = [
        r["name"]
        for r in rows(
            store,
            "SELECT s.name AS name FROM sweep_jobs sj JOIN sweeps s "
            "ON s.id = sj.sweep_id WHERE sj.job_id = :j ORDER BY s.name",
            {"j": j["id"]},
        )
    ]
    j["metrics"] = rows(
        store,
        "SELECT name, stage, task, who, step, value, value_kind, n_tokens, total "
        "FROM metrics WHERE job_id = :j ORDER BY name, stage, task, who, step",
        {"j": j["id"]},
    )
    return j


def progress(store: Store, name: str) -> dict[str, Any]:
    """What the live pages poll: per stage and status the job count, and every job's status."""
    return {
        "sweep": name,
        "stages": stage_counts(store, name).get(name, {}),
        "jobs": [
            {
                "key": j["key"],
                "stage": j["stage"],
                "status": j["status"],
                "attempts": j["attempts"],
                "duration_s": j["duration_s"],
                "error": last_line(j["error"]),
            }
            for j in sweep_jobs(store, name)
        ],
    }


def last_line(text: str | None) -> str:
    """The last non-blank line of an error (a traceback's exception), as `status` shows it."""
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def log_tail(path: str | None, limit: int = 64_000) -> str | None:
    """The end of a job's log file, where this machine can read it (a Ray worker's log may be elsewhere)."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - limit))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return ("…\n" + text.split("\n", 1)[-1]) if size > limit else text
