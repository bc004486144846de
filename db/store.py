"""Every read and write of the results database goes through `Store` (DESIGN.md §4).

SQLite by default (WAL, busy timeout, foreign keys, BEGIN IMMEDIATE for every transaction so a
read-then-write never loses an update); any SQLAlchemy URL works. Only the orchestrator writes.
"""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, delete, event, func, insert, select, text, update
from sqlalchemy.engine import Engine

from db.models import (
    Artifact,
    ConfigJob,
    Configuration,
    Job,
    LayerDiagnostic,
    Metric,
    PlanRow,
    Sweep,
    SweepJob,
)

VERSION_TABLE = "moesweep_alembic_version"
METRIC_FIELDS = ("name", "stage", "task", "who", "step", "value", "value_kind", "sum_nll", "n_tokens",
                 "correct", "total", "stderr", "num_fewshot", "headline")
CONFIG_FIELDS = ("model", "teacher_variant", "family", "kind", "baseline", "scoring", "grouping",
                 "dp_scaling", "K", "top_k", "distill_loss", "teacher_top_k", "distill_tokens",
                 "source_table", "selected_for_distill", "plan_key", "note", "variant")


def home() -> Path:
    """Where moesweep keeps its DB and artifacts unless told otherwise."""
    return Path(os.environ.get("MOESWEEP_HOME", ".moesweep")).resolve()


def default_url() -> str:
    return os.environ.get("MOESWEEP_DB") or f"sqlite:///{home() / 'moesweep.db'}"


def now() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


STALE_AFTER_S = 600.0  # a running job of another host whose heartbeat is older than this is taken over


def owner_dead(owner: str | None, heartbeat_at: datetime | None, stale_after_s: float = STALE_AFTER_S) -> bool:
    """Whether the launch that holds a running job is gone: on this host its process has ended; on
    another host (whose processes cannot be seen from here) its heartbeat is older than `stale_after_s`."""
    ohost, _, opid = (owner or "").rpartition(":")
    if ohost == socket.gethostname() and opid.isdigit():
        return not pid_alive(int(opid))
    return heartbeat_at is None or heartbeat_at < now() - timedelta(seconds=stale_after_s)


def classify(value: float | None) -> tuple[float | None, str]:
    """(value to store, value_kind): non-finite numbers are kept explicit, not as NULL noise."""
    if value is None:
        return None, "finite"
    v = float(value)
    if math.isnan(v):
        return None, "nan"
    if math.isinf(v):
        return None, "inf" if v > 0 else "-inf"
    return v, "finite"


class Store:
    def __init__(self, url: str | None = None, migrate: bool = True) -> None:
        self.url = url or default_url()
        self.engine = make_engine(self.url)
        if migrate:
            self.migrate()

    # ---- schema ---------------------------------------------------------------------------
    def migrate(self) -> None:
        from alembic import command
        from alembic.config import Config

        cfg = Config()
        cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
        cfg.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn

    # ---- sweeps ---------------------------------------------------------------------------
    def upsert_sweep(self, name: str, *, spec_yaml: str | None = None, spec_hash: str | None = None,
                     description: str | None = None, kind: str = "own", source: str = "moesweep",
                     select_json: str | None = None) -> int:
        """Insert or update a sweep; `select_json`: its selection rule as JSON (None: none stored)."""
        with self.tx() as c:
            return self._upsert_sweep(c, name, spec_yaml=spec_yaml, spec_hash=spec_hash,
                                      description=description, kind=kind, source=source,
                                      select_json=select_json)

    @staticmethod
    def _upsert_sweep(c: Connection, name: str, **values: Any) -> int:
        values["updated_at"] = now()
        sid = c.scalar(select(Sweep.id).where(Sweep.name == name))
        if sid is None:
            return c.execute(insert(Sweep).values(name=name, **values)).inserted_primary_key[0]
        c.execute(update(Sweep).where(Sweep.id == sid).values(**values))
        return sid

    def sweep_id(self, name: str) -> int | None:
        with self.tx() as c:
            return c.scalar(select(Sweep.id).where(Sweep.name == name))

    # ---- jobs -----------------------------------------------------------------------------
    def register_jobs(self, sweep_id: int, jobs: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Insert jobs that do not exist yet (by key) and link all of them to the sweep."""
        ids: dict[str, int] = {}
        with self.tx() as c:
            for j in jobs:
                jid = c.scalar(select(Job.id).where(Job.key == j["key"]))
                if jid is None:
                    jid = c.execute(insert(Job).values(
                        key=j["key"], stage=j["stage"], params_json=json.dumps(j["params"], sort_keys=True),
                        status="pending", attempts=0, code_version=j.get("code_version"),
                        code_json=j.get("code_json"),
                    )).inserted_primary_key[0]
                if c.scalar(select(SweepJob.id).where(SweepJob.sweep_id == sweep_id,
                                                      SweepJob.job_id == jid)) is None:
                    c.execute(insert(SweepJob).values(sweep_id=sweep_id, job_id=jid))
                ids[j["key"]] = jid
        return ids

    def jobs(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        keys = list(keys)
        out: dict[str, dict[str, Any]] = {}
        with self.tx() as c:
            for i in range(0, len(keys), 500):
                for row in c.execute(select(Job).where(Job.key.in_(keys[i:i + 500]))).mappings():
                    out[row["key"]] = dict(row)
        return out

    def claim(self, key: str, owner: str, retry_failed: bool = False) -> bool:
        """Atomically move a job to running for `owner`; False if someone else has it or it is done."""
        allowed = ["pending", "failed"] if retry_failed else ["pending"]
        with self.tx() as c:
            res = c.execute(update(Job).where(Job.key == key, Job.status.in_(allowed)).values(
                status="running", owner=owner, started_at=now(), heartbeat_at=now(), error=None,
                attempts=Job.attempts + 1))
            return res.rowcount == 1

    def heartbeat(self, keys: Iterable[str], owner: str) -> None:
        keys = list(keys)
        if not keys:
            return
        with self.tx() as c:
            c.execute(update(Job).where(Job.key.in_(keys), Job.owner == owner, Job.status == "running")
                      .values(heartbeat_at=now()))

    def release_stale(self, stale_after_s: float = STALE_AFTER_S) -> int:
        """Running jobs whose orchestrator is gone go back to pending (nothing they wrote counts)."""
        released = 0
        with self.tx() as c:
            rows = c.execute(select(Job.key, Job.owner, Job.heartbeat_at).where(Job.status == "running")).all()
            for key, owner, beat in rows:
                if owner_dead(owner, beat, stale_after_s):
                    c.execute(update(Job).where(Job.key == key, Job.status == "running")
                              .values(status="pending", owner=None))
                    released += 1
        return released

    def release(self, owner: str, key: str | None = None) -> int:
        """Give claimed jobs back untouched (e.g. on Ctrl-C before they finished): one, or every running
        job of `owner` (also one claimed a moment before the interrupt, which its owner may not know of)."""
        cond = [Job.owner == owner, Job.status == "running"] + ([Job.key == key] if key is not None else [])
        with self.tx() as c:
            return c.execute(update(Job).where(*cond).values(status="pending", owner=None,
                                                             attempts=Job.attempts - 1)).rowcount

    def finish(self, key: str, owner: str, result: dict[str, Any], duration_s: float,
               log_path: str | None = None, inputs: dict[str, dict[str, str]] | None = None) -> bool:
        """Write a job's records and mark it succeeded, in one transaction (idempotent per job).
        `inputs`: the upstream artifacts it read, {upstream job key: {path: content hash}}."""
        with self.tx() as c:
            jid = c.scalar(select(Job.id).where(Job.key == key, Job.owner == owner, Job.status == "running"))
            if jid is None:
                return False
            for table in (Metric, Artifact, PlanRow, LayerDiagnostic):
                c.execute(delete(table).where(table.job_id == jid))
            self._write_records(c, result, job_id=jid)
            c.execute(update(Job).where(Job.id == jid).values(
                status="succeeded", finished_at=now(), duration_s=duration_s,
                compute_s=result.get("compute_s"), log_path=log_path,
                versions_json=json.dumps(result.get("versions", {}), sort_keys=True),
                outputs_json=json.dumps(result.get("outputs", {}), sort_keys=True),
                inputs_json=None if inputs is None else json.dumps(inputs, sort_keys=True), error=None))
            return True

    # ---- artifacts --------------------------------------------------------------------------
    def artifacts(self, keys: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """{job key: its artifact rows} for the given jobs (every key present, [] for none)."""
        keys = list(dict.fromkeys(keys))
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
        with self.tx() as c:
            for i in range(0, len(keys), 500):
                q = (select(Job.key, Artifact.id, Artifact.kind, Artifact.path, Artifact.content_hash,
                            Artifact.size_bytes, Artifact.mtime)
                     .join(Job, Job.id == Artifact.job_id).where(Job.key.in_(keys[i:i + 500]))
                     .order_by(Artifact.id))
                for row in c.execute(q).mappings():
                    out[row["key"]].append(dict(row))
        return out

    def artifact_jobs(self, sweep_id: int | None = None) -> list[dict[str, Any]]:
        """Succeeded jobs that recorded artifacts (of one sweep, or all): key, stage, job id."""
        q = (select(Job.key, Job.stage, Job.id).where(Job.status == "succeeded")
             .where(Job.id.in_(select(Artifact.job_id))).order_by(Job.id))
        if sweep_id is not None:
            q = q.where(Job.id.in_(select(SweepJob.job_id).where(SweepJob.sweep_id == sweep_id)))
        with self.tx() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    def update_artifact(self, artifact_id: int, *, mtime: float | None, size_bytes: int | None) -> None:
        """The content is unchanged but its size/mtime fingerprint moved (or was never stored): store it."""
        with self.tx() as c:
            c.execute(update(Artifact).where(Artifact.id == artifact_id)
                      .values(mtime=mtime, size_bytes=size_bytes))

    def mark_stale(self, key: str, reason: str) -> bool:
        """A succeeded job whose artifact changed, or whose input was recomputed with other content, goes
        back to `pending` with `reason` as its error: the next launch (or this one) recomputes it. Its
        records stay until the recomputation replaces them. False if it was not succeeded (any more)."""
        with self.tx() as c:
            return c.execute(update(Job).where(Job.key == key, Job.status == "succeeded").values(
                status="pending", owner=None, error=f"stale: {reason}"[-4000:])).rowcount == 1

    def add_partial_metrics(self, key: str, owner: str, metrics: list[dict[str, Any]]) -> int:
        """Metrics a running job reports before it ends (its final record replaces them in `finish`)."""
        with self.tx() as c:
            jid = c.scalar(select(Job.id).where(Job.key == key, Job.owner == owner, Job.status == "running"))
            if jid is None:
                return 0
            for m in metrics:  # a re-sent record replaces the earlier copy (unique per name/stage/task/who/step)
                step = -1 if m.get("step") is None else int(m["step"])
                c.execute(delete(Metric).where(Metric.job_id == jid, Metric.name == m["name"],
                                               Metric.stage == (m.get("stage") or ""), Metric.task == (m.get("task") or ""),
                                               Metric.who == (m.get("who") or ""), Metric.step == step))
            self._write_records(c, {"metrics": metrics}, job_id=jid)
            return len(metrics)

    def fail(self, key: str, owner: str, error: str, final: bool, log_path: str | None = None,
             duration_s: float | None = None) -> None:
        with self.tx() as c:
            c.execute(update(Job).where(Job.key == key, Job.owner == owner).values(
                status="failed" if final else "pending", error=error[-4000:], finished_at=now(),
                log_path=log_path, duration_s=duration_s, owner=owner if final else None))

    @staticmethod
    def _write_records(c: Connection, result: dict[str, Any], *, job_id: int | None = None,
                       config_id: int | None = None) -> None:
        metrics = []
        for m in result.get("metrics", []):
            row = {f: m.get(f) for f in METRIC_FIELDS}
            value, kind = classify(m.get("value"))
            row.update(value=value, value_kind=m.get("value_kind") or kind, task=m.get("task") or "",
                       stage=m.get("stage") or "", who=m.get("who") or "",
                       step=-1 if m.get("step") is None else int(m["step"]),
                       headline=int(bool(m.get("headline"))), job_id=job_id, config_id=config_id,
                       extra_json=json.dumps(m["extra"], sort_keys=True) if m.get("extra") else None)
            metrics.append(row)
        if metrics:
            c.execute(insert(Metric), metrics)
        if job_id is None:
            return
        for table, name in ((Artifact, "artifacts"), (PlanRow, "plan_rows"), (LayerDiagnostic, "layer_diag")):
            rows = [dict(r, job_id=job_id) for r in result.get(name, [])]
            if rows:
                c.execute(insert(table), rows)

    # ---- configurations -------------------------------------------------------------------
    def upsert_configs(self, sweep_id: int, configs: Iterable[dict[str, Any]]) -> dict[str, int]:
        ids: dict[str, int] = {}
        with self.tx() as c:
            for cfg in configs:
                values = {f: cfg.get(f) for f in CONFIG_FIELDS if f in cfg}
                cid = c.scalar(select(Configuration.id).where(Configuration.sweep_id == sweep_id,
                                                              Configuration.config_key == cfg["config_key"]))
                if cid is None:
                    cid = c.execute(insert(Configuration).values(
                        sweep_id=sweep_id, config_key=cfg["config_key"], **values)).inserted_primary_key[0]
                else:
                    c.execute(update(Configuration).where(Configuration.id == cid).values(**values))
                ids[cfg["config_key"]] = cid
        return ids

    def link(self, links: Iterable[tuple[int, str, int]]) -> None:
        """(config_id, stage, job_id): which job produced a configuration's numbers for a stage."""
        with self.tx() as c:
            for config_id, stage, job_id in links:
                cur = c.scalar(select(ConfigJob.job_id).where(ConfigJob.config_id == config_id,
                                                              ConfigJob.stage == stage))
                if cur is None:
                    c.execute(insert(ConfigJob).values(config_id=config_id, stage=stage, job_id=job_id))
                elif cur != job_id:
                    c.execute(update(ConfigJob).where(ConfigJob.config_id == config_id,
                                                      ConfigJob.stage == stage).values(job_id=job_id))

    def set_config_fields(self, updates: dict[int, dict[str, Any]]) -> None:
        with self.tx() as c:
            for cid, values in updates.items():
                c.execute(update(Configuration).where(Configuration.id == cid).values(**values))

    def configs(self, sweep_id: int) -> list[dict[str, Any]]:
        with self.tx() as c:
            return [dict(r) for r in c.execute(
                select(Configuration).where(Configuration.sweep_id == sweep_id).order_by(Configuration.id)
            ).mappings()]

    # ---- reading ----------------------------------------------------------------------------
    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple]]:
        with self.engine.connect() as c:
            res = c.execute(text(sql), params or {})
            if not res.returns_rows:
                c.commit()
                return [], []
            return list(res.keys()), [tuple(r) for r in res.all()]

    def job_counts(self, sweep_id: int) -> dict[tuple[str, str], int]:
        with self.tx() as c:
            rows = c.execute(select(Job.stage, Job.status, func.count()).join(SweepJob, SweepJob.job_id == Job.id)
                             .where(SweepJob.sweep_id == sweep_id).group_by(Job.stage, Job.status)).all()
        return {(stage, status): n for stage, status, n in rows}

    # ---- reference data (papers) ------------------------------------------------------------
    def import_reference(self, sweeps: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Load published numbers as reference sweeps, all in one transaction (all or nothing);
        re-importing replaces them (idempotent). A sweep may carry `select` (its selection rule, a dict
        stored as JSON); a configuration may carry `variant` and `variant_of_key`, the config_key of the
        main configuration of the same sweep that it varies."""
        counts: dict[str, int] = {}
        with self.tx() as c:
            for sw in sweeps:
                rule = sw.get("select")
                sid = self._upsert_sweep(c, sw["name"], description=sw.get("description"), kind="reference",
                                         source=sw.get("source", "paper"), spec_yaml=None, spec_hash=None,
                                         select_json=json.dumps(rule, sort_keys=True) if rule else None)
                c.execute(delete(Configuration).where(Configuration.sweep_id == sid))
                ids: dict[str, int] = {}
                for i, cfg in enumerate(sw["configs"]):
                    values = {f: cfg.get(f) for f in CONFIG_FIELDS if f in cfg}
                    values.setdefault("source_table", cfg.get("table"))
                    key = cfg.get("config_key") or f"{cfg.get('table', 'ref')}:{i}"
                    ids[key] = c.execute(insert(Configuration).values(
                        sweep_id=sid, config_key=key, **values)).inserted_primary_key[0]
                    self._write_records(c, {"metrics": cfg.get("metrics", [])}, config_id=ids[key])
                for i, cfg in enumerate(sw["configs"]):
                    main = cfg.get("variant_of_key")
                    if main is None:
                        continue
                    key = cfg.get("config_key") or f"{cfg.get('table', 'ref')}:{i}"
                    if main not in ids or main == key:
                        raise ValueError(f"reference sweep {sw['name']!r}, configuration {key!r}: "
                                         f"variant_of_key {main!r} is not another configuration of the "
                                         "sweep; allowed: its other config_keys")
                    c.execute(update(Configuration).where(Configuration.id == ids[key])
                              .values(variant_of=ids[main]))
                counts[sw["name"]] = len(sw["configs"])
        return counts


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30, "isolation_level": None})

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn) -> None:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True)
