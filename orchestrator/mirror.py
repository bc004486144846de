"""Mirroring: the curves of finished jobs in TensorBoard, W&B or MLflow (`execution.mirror`, `moesweep mirror`).

A job's curves are its stepped metrics as the database holds them (step >= 0, outside the evaluations before
and after training, metric stages `pre` and `post`): a distillation's training loss and the validation
cross-entropy of student and teacher, Router KD's and DOT-MoE's losses, a teacher's training loss, DCDM's
rounds. Each succeeded job with curves is one run, named by a readable label (the key of the configuration
it serves, or its stage for a shared job such as the teacher) and its key's first 12 characters, with its
hyperparameters (the configuration's fields as `config.*`, the job's parameters flattened, e.g.
`settings.lr`) and one scalar series per metric (`val_ce/student`) by step. Mirroring a job again replaces
its run: TensorBoard rewrites the run's folder, MLflow deletes the earlier run it finds by tag, W&B
resumes the run of the same id and logs only the steps it does not hold yet.

Only the orchestrator mirrors, reading the database: `attach` makes a launch mirror each job it finishes
right after its record is stored; `moesweep mirror NAME` mirrors a sweep's finished jobs after the fact.
The trackers' packages are imported when used: tensorboardX is a dependency, wandb and mlflow optional. A
tracker that fails is one warning line: it never changes a launch's exit code, and every record is
already in the database.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from db.axes import config_fields
from db.store import Store
from orchestrator.schema import one_line
from orchestrator.spec import Mirror
from orchestrator.stage import get_stage

KEY_SHOWN = 12  # characters of a job's key in a run's name (as `moesweep status` shows keys)
EVENTS = "events.out.tfevents."  # what TensorBoard event files' names start with
EVAL_STAGES = ("pre", "post")  # metric stages of evaluations: their steps index repeats, not training
NOT_HPARAMS = frozenset({"source_table", "selected_for_distill", "plan_key", "note", "settings"})
MAX_TEXT = 250  # characters of a text hyperparameter (MLflow refuses longer parameter values)
Hparam = str | int | float | bool


class MirrorError(Exception):
    """A tracker could not take a run; the message is one line."""


@dataclass
class Run:
    """One job's curves as a tracker takes them."""

    sweep: str
    stage: str
    key: str
    label: str  # the configuration's key, or the stage for a job of no one configuration
    hparams: dict[str, Hparam] = field(default_factory=dict)
    points: list[tuple[int, str, float]] = field(default_factory=list)  # (step, tag, value), by step

    @property
    def name(self) -> str:
        """The run's name: its label (as a file name) and its key's first characters."""
        return f"{_safe(self.label, 80)}-{self.key[:KEY_SHOWN]}"

    def steps(self) -> list[tuple[int, dict[str, float]]]:
        """[(step, {tag: value})] in step order (W&B logs a step's values together)."""
        out: dict[int, dict[str, float]] = {}
        for step, tag, value in self.points:
            out.setdefault(step, {})[tag] = value
        return sorted(out.items())


def _safe(text: str, limit: int) -> str:
    """`text` as one path component: every character but letters, digits and . _ = + - becomes _."""
    return re.sub(r"[^A-Za-z0-9._=+-]", "_", text).lstrip(".-")[:limit] or "_"


def _tag_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def _value(value: float | None, kind: str) -> float | None:
    """The number a metric row stands for (non-finite numbers are stored as NULL and their kind)."""
    if value is not None:
        return float(value)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(kind)


def _hparam(value: Any) -> Hparam | None:
    if value is None:
        return None
    if isinstance(value, bool | int | str):
        return value if not isinstance(value, str) else value[:MAX_TEXT]
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return json.dumps(value, sort_keys=True, default=str)[:MAX_TEXT]


def _flatten(node: Any, prefix: str, out: dict[str, Hparam]) -> None:
    """The leaves of a JSON value as dotted keys (a list is one value, as JSON text)."""
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
        return
    value = _hparam(node)
    if value is not None and prefix:
        out[prefix] = value


def _shared(stage: str) -> bool:
    """Whether a stage's job serves every configuration by design (the teacher, calibration)."""
    try:
        return get_stage(stage).shared
    except ValueError:  # a stage this moesweep does not declare
        return False


def _rows(store: Store, sql: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    cols, rows = store.query(sql, params)
    return [dict(zip(cols, r, strict=True)) for r in rows]


def runs(
    store: Store, sweep: str, key: str | None = None, config_keys: Iterable[str] | None = None
) -> list[Run]:
    """The runs of the sweep's succeeded jobs with curves (of the one job `key`), from the database. A
    job's configurations are those linked to it for its stage, or with `key` the `config_keys` where given
    (a launch names a job's configurations before it links them)."""
    one = " AND j.key = :key" if key is not None else ""
    params = {"sweep": sweep, "key": key}
    within = (
        "JOIN sweep_jobs sj ON sj.job_id = j.id JOIN sweeps s ON s.id = sj.sweep_id "
        f"WHERE s.name = :sweep AND j.status = 'succeeded'{one}"
    )
    evals = ", ".join(f"'{s}'" for s in EVAL_STAGES)
    points = _rows(
        store,
        "SELECT m.job_id, m.name, m.stage, m.task, m.who, m.step, m.value, m.value_kind "
        f"FROM metrics m JOIN jobs j ON j.id = m.job_id {within} AND m.step >= 0 AND m.stage NOT IN ({evals}) "
        "ORDER BY m.job_id, m.step, m.name, m.task, m.who, m.stage",
        params,
    )
    if not points:
        return []
    jobs = {
        r["id"]: r
        for r in _rows(store, f"SELECT j.id, j.key, j.stage, j.params_json FROM jobs j {within}", params)
    }
    if config_keys is None or key is None:
        linked = _rows(
            store,
            "SELECT cj.job_id AS link_job, c.* FROM config_jobs cj JOIN configurations c ON c.id = cj.config_id "
            f"JOIN jobs j ON j.id = cj.job_id {within} AND cj.stage = j.stage AND c.sweep_id = s.id "
            "ORDER BY c.id",
            params,
        )
    else:
        named = set(config_keys)
        linked = [
            dict(c, link_job=job_id)
            for c in _rows(
                store,
                "SELECT c.* FROM configurations c JOIN sweeps s ON s.id = c.sweep_id WHERE s.name = :sweep "
                "ORDER BY c.id",
                {"sweep": sweep},
            )
            if c["config_key"] in named
            for job_id in jobs
        ]
    configs: dict[int, list[dict[str, Any]]] = {}
    for c in linked:
        configs.setdefault(c["link_job"], []).append(c)
    by_job: dict[int, list[dict[str, Any]]] = {}
    for p in points:
        by_job.setdefault(p["job_id"], []).append(p)
    return [_run(sweep, jobs[jid], configs.get(jid, []), rows) for jid, rows in by_job.items() if jid in jobs]


def _run(sweep: str, job: dict[str, Any], configs: list[dict[str, Any]], rows: list[dict[str, Any]]) -> Run:
    stage = job["stage"]
    mine = [] if _shared(stage) else configs
    main = [c for c in mine if c.get("duplicate_of") is None] or mine
    label = main[0]["config_key"] if main else stage
    hp: dict[str, Hparam] = {}
    _flatten(json.loads(job["params_json"] or "{}"), "", hp)
    if main:
        for f in config_fields():
            value = _hparam(main[0].get(f))
            if f not in NOT_HPARAMS and value is not None:
                hp[f"config.{f}"] = value
        if main[0].get("settings"):
            _flatten(json.loads(main[0]["settings"]), "config.settings", hp)
    if len(mine) > 1:
        hp["configurations"] = ", ".join(c["config_key"] for c in mine)[:MAX_TEXT]
    hp.update(sweep=sweep, stage=stage, job=job["key"], configuration=label)
    # a series per metric: name[/task][/who], led by its metric stage where two stages share that name
    tag = {
        i: "/".join(_tag_part(p) for p in (r["name"], r["task"], r["who"]) if p) for i, r in enumerate(rows)
    }
    stages: dict[str, set[str]] = {}
    for i, r in enumerate(rows):
        stages.setdefault(tag[i], set()).add(r["stage"])
    points = []
    for i, r in enumerate(rows):
        value = _value(r["value"], r["value_kind"])
        if value is None:  # no number (e.g. a skipped task)
            continue
        t = tag[i] if len(stages[tag[i]]) == 1 else f"{_tag_part(r['stage'] or 'none')}/{tag[i]}"
        points.append((int(r["step"]), t, value))
    points.sort(key=lambda p: (p[0], p[1]))
    return Run(sweep, stage, job["key"], label, hp, points)


# ---- the trackers -------------------------------------------------------------------------------------
def write_tensorboard(root: str, run: Run) -> Path:
    """The run's event files in `root`/<sweep>/<stage>/<run name>/ (hyperparameters and one scalar series
    per tag), replacing the folder of an earlier mirror of the same job. Written beside it first, so a
    failure leaves the earlier folder as it was."""
    try:
        from tensorboardX import SummaryWriter
        from tensorboardX.summary import hparams
    except ImportError as e:
        raise MirrorError(
            f"mirror.tensorboard needs the tensorboardX package ({e}): pip install tensorboardX"
        ) from None
    parent = Path(root).expanduser() / _safe(run.sweep, 100) / _safe(run.stage, 40)
    target = parent / run.name
    earlier = sorted(parent.glob(f"*-{run.key[:KEY_SHOWN]}")) if parent.is_dir() else []
    writing = parent / f".{run.name}.writing"
    for d in [*earlier, writing]:
        _check_events_only(d)
    try:
        _remove(writing)
        with SummaryWriter(logdir=str(writing), flush_secs=3600) as w:
            # the session's hyperparameters, no experiment summary: TensorBoard takes the first one it finds
            # as every run's, while without one it gathers the columns from all runs' hyperparameters
            _, start, end = hparams(run.hparams, {})
            w.file_writer.add_summary(start)
            w.file_writer.add_summary(end)
            for step, tag, value in run.points:
                w.add_scalar(tag, value, step)
        for d in earlier:
            _remove(d)
        os.replace(writing, target)
    except OSError as e:
        raise MirrorError(f"cannot write {target}: {e.strerror or e}") from None
    return target


def _check_events_only(d: Path) -> None:
    """A folder about to be replaced holds TensorBoard event files only (it is the run of a mirror):
    anything else is left alone, and the job is not mirrored there."""
    if not os.path.lexists(d):
        return
    if d.is_symlink() or not d.is_dir():
        raise MirrorError(f"{d} is not a folder of event files: left as it is")
    other = [p.name for p in d.iterdir() if not (p.is_file() and p.name.startswith(EVENTS))]
    if other:
        raise MirrorError(f"{d} holds other files than event files ({other[0]}): left as it is")


def _remove(d: Path) -> None:
    if os.path.lexists(d):
        shutil.rmtree(d)


def _module(name: str, tracker: str) -> Any:
    """A tracker's package, imported on first use (optional: not a dependency of moesweep)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        package = name.split(".")[0]
        raise MirrorError(f"mirror.{tracker} needs the {package} package: pip install {package}") from None


def _run_id(run: Run) -> str:
    """A W&B run id of the sweep and the job (the same run each time the job is mirrored)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"{run.sweep}-{run.key}")[:64]


def log_wandb(project: str, run: Run) -> str:
    """The run in W&B project `project` ("PROJECT" or "ENTITY/PROJECT"): the sweep as its group, the stage
    as its job type, the hyperparameters as its config, each step's values together. Mirrored again, the
    run of the same id is resumed and only steps from its current step on are logged."""
    wandb = _module("wandb", "wandb")
    entity, _, name = project.rpartition("/")
    r = wandb.init(
        project=name,
        entity=entity or None,
        id=_run_id(run),
        name=run.name,
        group=run.sweep,
        job_type=run.stage,
        resume="allow",
        settings=wandb.Settings(silent=True, console="off"),  # the launch's console stays the launch's
    )
    try:
        r.config.update(run.hparams, allow_val_change=True)
        start = int(r.step or 0) if getattr(r, "resumed", False) else 0
        for step, values in run.steps():
            if step >= start:
                r.log(values, step=step)
    finally:
        r.finish()
    return f"{project} run {_run_id(run)}"


def log_mlflow(uri: str, run: Run) -> str:
    """The run in the MLflow tracking server `uri`, experiment = the sweep's name (created if needed),
    tagged with the sweep and the job's key; an earlier run of the same job there is deleted first."""
    tracking = _module("mlflow.tracking", "mlflow")
    entities = _module("mlflow.entities", "mlflow")
    client = tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(run.sweep)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(run.sweep)
    tags = {"moesweep_sweep": run.sweep, "moesweep_job": run.key, "moesweep_stage": run.stage}
    found = f"tags.moesweep_sweep = '{run.sweep}' and tags.moesweep_job = '{run.key}'"
    for old in client.search_runs(experiment_ids=[exp_id], filter_string=found):
        client.delete_run(old.info.run_id)
    created = client.create_run(exp_id, tags=tags, run_name=run.name)
    rid = created.info.run_id
    now = int(time.time() * 1000)
    params = [
        entities.Param(re.sub(r"[^A-Za-z0-9_.\-/ ]", "_", k)[:250], str(v)[:MAX_TEXT])
        for k, v in run.hparams.items()
    ]
    metrics = [entities.Metric(tag, value, now, step) for step, tag, value in run.points]
    for i in range(0, len(params), 100):  # MLflow's limits per batch: 100 parameters, 1000 metrics
        client.log_batch(rid, params=params[i : i + 100])
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i : i + 1000])
    client.set_terminated(rid)
    return f"{uri} experiment {run.sweep} run {rid}"


TRACKERS: dict[str, Callable[[str, Run], Any]] = {
    "tensorboard": write_tensorboard,
    "wandb": log_wandb,
    "mlflow": log_mlflow,
}


# ---- mirroring ----------------------------------------------------------------------------------------
def mirror_runs(targets: dict[str, str], found: list[Run], warn: Callable[[str], None]) -> tuple[int, int]:
    """Each run to each tracker of `targets` ({tracker: where}); (runs written, failures). A failure is one
    `warn` line; the other runs and trackers go on."""
    done = failed = 0
    for run in found:
        for tracker, where in targets.items():
            try:
                TRACKERS[tracker](where, run)
                done += 1
            except Exception as e:  # a tracker is an extra: whatever went wrong, one line
                failed += 1
                why = str(e) if isinstance(e, MirrorError) else f"{type(e).__name__}: {e}"
                warn(f"mirror to {tracker} of {run.stage} {run.key[:KEY_SHOWN]} ({run.label}): {why}")
    return done, failed


def mirror_sweep(
    store: Store,
    sweep: str,
    targets: dict[str, str],
    warn: Callable[[str], None],
    key: str | None = None,
    config_keys: Iterable[str] | None = None,
) -> tuple[int, int]:
    """The sweep's finished jobs with curves (the one job `key`) to each tracker of `targets`: (runs
    written, failures). Never raises but KeyboardInterrupt: a problem is one `warn` line."""
    try:
        found = runs(store, sweep, key, config_keys)
    except Exception as e:
        warn(
            f"mirror of {f'job {key[:KEY_SHOWN]}' if key else f'sweep {sweep}'}: cannot read its curves: {e}"
        )
        return 0, 1
    return mirror_runs(targets, found, warn)


def attach(runner: Any, spec: Any, store: Store, ctx: Any, console: Console) -> None:
    """Make `runner` (a launch's) mirror each job it finishes to the sweep's `execution.mirror`, right after
    the job's record is stored; nothing when the sweep mirrors nowhere."""
    if spec.execution.mirror is None:
        return
    targets = spec.execution.mirror.trackers()

    def stored(stage: str, key: str) -> None:
        named = [ck for ck, j in ctx.jobs.get(stage, {}).items() if j.key == key]
        mirror_sweep(store, spec.name, targets, lambda m: warn(console, m), key=key, config_keys=named)

    runner.on_stored = stored


def warn(console: Console, message: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(one_line(message))}", highlight=False, soft_wrap=True)


def targets_of(options: dict[str, str | None]) -> dict[str, str]:
    """{tracker: where} of command-line options ({"tensorboard": DIR or None, ...}), checked as a sweep
    file's `execution.mirror` is; a one-line MirrorError naming the option otherwise."""
    given = {t: v for t, v in options.items() if v is not None}
    if not given:
        return {}
    try:
        return Mirror.model_validate(given).trackers()
    except ValidationError as e:
        raise MirrorError(_problem(e, "--")) from None


def stored_targets(store: Store, sweep: str) -> dict[str, str]:
    """{tracker: where} of the `execution.mirror` of the sweep's stored spec ({} where it names none)."""
    _, rows = store.query("SELECT spec_yaml FROM sweeps WHERE name = :s", {"s": sweep})
    text = rows[0][0] if rows else None
    try:
        raw = yaml.safe_load(text) if text else None
    except yaml.YAMLError:
        return {}
    execution = raw.get("execution") if isinstance(raw, dict) else None
    value = execution.get("mirror") if isinstance(execution, dict) else None
    if value is None:
        return {}
    try:
        return Mirror.model_validate(value).trackers()
    except ValidationError as e:
        raise MirrorError(f"the stored spec of sweep {sweep}: {_problem(e, 'execution.mirror.')}") from None


def _problem(e: ValidationError, prefix: str) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    at = f"{prefix}{where}" if where else prefix.rstrip(".-")
    return one_line(f"{at}: {msg}" if at else msg)
