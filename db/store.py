"""Every read and write of the results database goes through `Store`.

SQLite by default (WAL, busy timeout, foreign keys, BEGIN IMMEDIATE for every transaction so a
read-then-write never loses an update); any SQLAlchemy URL works. Only the orchestrator writes;
`moesweep sql` and `status` open the database with `Store(url, read_only=True)`, which cannot change it
(nor, on PostgreSQL, the server's files: a privileged login reads as the role `moesweep_reader`).
Every problem opening a database is one `StoreError` with a one-line message.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import socket
import sqlite3
import stat
import textwrap
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, create_engine, delete, event, func, insert, inspect, select, text, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, IntegrityError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.pool import NullPool

from db.axes import config_fields
from db.items import item_row
from db.models import (
    Artifact,
    ConfigJob,
    Configuration,
    ItemScore,
    Job,
    LayerDiagnostic,
    Metric,
    PlanRow,
    StageOrder,
    Sweep,
    SweepJob,
)

VERSION_TABLE = "moesweep_alembic_version"
METRIC_FIELDS = (
    "name",
    "stage",
    "task",
    "who",
    "step",
    "value",
    "value_kind",
    "sum_nll",
    "n_tokens",
    "correct",
    "total",
    "stderr",
    "num_fewshot",
    "headline",
)
CONFIG_FIELDS = config_fields()  # its description and axes (db/axes.py)


def home() -> Path:
    """Where moesweep keeps its DB and artifacts unless told otherwise."""
    return Path(os.environ.get("MOESWEEP_HOME", "").strip() or ".moesweep").resolve()  # empty: unset


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


def owner_dead(
    owner: str | None, heartbeat_at: datetime | None, stale_after_s: float = STALE_AFTER_S
) -> bool:
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


def _upsert(c: Connection, table: Any) -> Any:
    """The dialect's INSERT, which has ON CONFLICT (SQLite and PostgreSQL): the atomic insert-or-update
    that two launches writing the same rows at once need."""
    return (postgresql if c.dialect.name == "postgresql" else sqlite).insert(table)


class StoreError(Exception):
    """The database cannot be opened or used as asked. str(error) is one line meant for the user;
    `about_url` marks a URL that is malformed or names an unknown database kind or driver."""

    def __init__(self, message: str, about_url: bool = False) -> None:
        super().__init__(" ".join(message.split()))
        self.about_url = about_url


MIGRATIONS = Path(__file__).parent / "migrations"


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


class Store:
    """`Store(url)` opens a database to read and write, creating and migrating it where needed;
    `Store(url, create=False)` only one that exists at this moesweep's schema (it creates and migrates
    nothing). `Store(url, read_only=True)` opens an existing one for reading only: it never migrates, never
    creates a database, and refuses every write, DDL, ATTACH and state-changing PRAGMA (SQLite: `mode=ro`,
    `query_only` and an authorizer; PostgreSQL: read-only transactions, one query at a time, and a role
    that cannot touch the server's files). Every problem opening the database is one `StoreError`, and so
    is a database found damaged or read-only later."""

    def __init__(
        self, url: str | None = None, migrate: bool = True, read_only: bool = False, create: bool = True
    ) -> None:
        self.url = url or default_url()
        self.read_only = read_only
        self.shown = shown_url(self.url)
        self.engine = make_engine(self.url, read_only=read_only, create=create)
        if read_only:  # disposed of when the store goes, at the latest at exit: see _sqlite_reader
            weakref.finalize(self, self.engine.dispose)
        try:
            if read_only or not create:
                self.check_revision()
            elif migrate:
                self.migrate()
        except StoreError:
            self.engine.dispose()
            raise

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Database and file-system errors become one StoreError."""
        try:
            yield
        except StoreError:
            raise
        except (SQLAlchemyError, OSError) as e:
            raise StoreError(explain(self.url, e, self.read_only)) from None

    # ---- schema ---------------------------------------------------------------------------
    def migrate(self) -> None:
        from alembic import command
        from alembic.config import Config
        from alembic.util import CommandError

        if self.read_only:
            raise StoreError(f"{self.shown} was opened read-only: it cannot be migrated")
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        cfg.set_main_option("sqlalchemy.url", self.url.replace("%", "%%"))
        with self._errors(), self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            try:
                command.upgrade(cfg, "head")
            except CommandError as e:
                why = str(e).splitlines()[0]
                if "locate revision" in why:
                    why += f", unknown to this moesweep (head {head_revision()}): a newer moesweep wrote it"
                raise StoreError(f"cannot migrate {self.shown}: {why}") from None

    @staticmethod
    def revision(conn: Connection) -> str | None:
        """The schema revision in the database, or None where there is no moesweep schema."""
        if not inspect(conn).has_table(VERSION_TABLE):
            return None
        return conn.scalar(text(f"SELECT version_num FROM {VERSION_TABLE}"))

    def check_revision(self) -> None:
        """A StoreError unless the database has this moesweep's schema at the head revision."""
        from alembic.script import ScriptDirectory
        from alembic.util import CommandError

        with self._errors(), self.engine.connect() as c:
            rev = self.revision(c)
        head = head_revision()
        if rev == head:
            return
        upgrade = f"moesweep migrate --db '{make_url(self.url).render_as_string(hide_password=True)}'"
        if rev is None:
            raise StoreError(
                f"{self.shown} is not a moesweep database (no revision in {VERSION_TABLE}); "
                f"`moesweep launch` or `{upgrade}` creates the schema"
            )
        try:
            known = ScriptDirectory(str(MIGRATIONS)).get_revision(rev) is not None
        except CommandError:
            known = False
        if not known:
            raise StoreError(
                f"{self.shown} is at schema revision {rev!r}, unknown to this moesweep (head "
                f"{head}): a newer moesweep wrote it; upgrade moesweep to read it"
            )
        raise StoreError(
            f"{self.shown} is at schema revision {rev}, this moesweep needs {head}: "
            f"upgrade it with `{upgrade}` (or `moesweep launch`)"
        )

    @contextmanager
    def tx(self) -> Iterator[Connection]:
        """One transaction; a database that turns out damaged or read-only is one StoreError."""
        try:
            with self.engine.begin() as conn:
                yield conn
        except DBAPIError as e:
            if not unusable(e):
                raise
            raise StoreError(explain(self.url, e, self.read_only)) from None

    # ---- sweeps ---------------------------------------------------------------------------
    def upsert_sweep(
        self,
        name: str,
        *,
        spec_yaml: str | None = None,
        spec_hash: str | None = None,
        description: str | None = None,
        kind: str = "own",
        source: str = "moesweep",
        select_json: str | None = None,
    ) -> int:
        """Insert or update a sweep; `select_json`: its selection rule as JSON (None: none stored)."""
        with self.tx() as c:
            return self._upsert_sweep(
                c,
                name,
                spec_yaml=spec_yaml,
                spec_hash=spec_hash,
                description=description,
                kind=kind,
                source=source,
                select_json=select_json,
            )

    @staticmethod
    def _upsert_sweep(c: Connection, name: str, **values: Any) -> int:
        # a new name is one atomic upsert: two launches of one sweep at once (a select, then an insert) both
        # saw no row and the second insert broke the unique name
        values["updated_at"] = now()
        sid = c.scalar(select(Sweep.id).where(Sweep.name == name))
        if sid is not None:  # the common case first: PostgreSQL's ON CONFLICT spends a sequence number
            c.execute(update(Sweep).where(Sweep.id == sid).values(**values))
            return sid
        stmt = _upsert(c, Sweep).values(name=name, **values)
        return c.scalar(
            stmt.on_conflict_do_update(index_elements=[Sweep.name], set_=values).returning(Sweep.id)
        )

    def stored_spec_hash(self, name: str) -> str | None:
        """The spec hash the sweep's last launch stored (None: no such sweep, or none stored)."""
        with self.tx() as c:
            return c.scalar(select(Sweep.spec_hash).where(Sweep.name == name))

    def sweep_id(self, name: str) -> int | None:
        with self.tx() as c:
            return c.scalar(select(Sweep.id).where(Sweep.name == name))

    # ---- stages ---------------------------------------------------------------------------
    def record_stages(self, names: Iterable[str]) -> None:
        """Record the order a launch runs its stages in (table `stages`), so readers order stages without
        the orchestrator's registry; a launch with another order replaces it, one with the same writes
        nothing."""
        want = {name: i for i, name in enumerate(dict.fromkeys(names))}
        for attempt in (1, 2):
            try:
                with self.tx() as c:
                    have = dict(c.execute(select(StageOrder.name, StageOrder.position)).all())
                    if have == want:
                        return
                    gone = [n for n in have if n not in want]
                    if gone:
                        c.execute(delete(StageOrder).where(StageOrder.name.in_(gone)))
                    for name, pos in want.items():
                        if name not in have:
                            c.execute(insert(StageOrder).values(name=name, position=pos))
                        elif have[name] != pos:
                            c.execute(update(StageOrder).where(StageOrder.name == name).values(position=pos))
                return
            except IntegrityError:  # another launch inserted the same stage meanwhile: read it and go on
                if attempt == 2:
                    raise

    def stage_order(self) -> list[str]:
        """The stages in launch order as the orchestrator recorded it, then any other stage the jobs name,
        in the order they first appear (a database no launch has recorded an order in yet: that order)."""
        with self._errors(), self.engine.connect() as c:
            names = list(c.scalars(select(StageOrder.name).order_by(StageOrder.position, StageOrder.name)))
            names += c.scalars(select(Job.stage).group_by(Job.stage).order_by(func.min(Job.id)))
            c.rollback()
        return list(dict.fromkeys(names))

    # ---- jobs -----------------------------------------------------------------------------
    def register_jobs(self, sweep_id: int, jobs: Iterable[dict[str, Any]]) -> dict[str, int]:
        """Insert jobs that do not exist yet (by key) and link all of them to the sweep."""
        ids: dict[str, int] = {}
        with self.tx() as c:
            # insert-or-ignore, then read: atomic when two launches register the same job at once
            for j in jobs:
                jid = c.scalar(select(Job.id).where(Job.key == j["key"]))
                if jid is None:
                    c.execute(
                        _upsert(c, Job)
                        .values(
                            key=j["key"],
                            stage=j["stage"],
                            params_json=json.dumps(j["params"], sort_keys=True),
                            status="pending",
                            attempts=0,
                            code_version=j.get("code_version"),
                            code_json=j.get("code_json"),
                        )
                        .on_conflict_do_nothing(index_elements=[Job.key])
                    )
                    jid = c.scalar(select(Job.id).where(Job.key == j["key"]))
                if (
                    c.scalar(select(SweepJob.id).where(SweepJob.sweep_id == sweep_id, SweepJob.job_id == jid))
                    is None
                ):
                    c.execute(
                        _upsert(c, SweepJob)
                        .values(sweep_id=sweep_id, job_id=jid)
                        .on_conflict_do_nothing(index_elements=[SweepJob.sweep_id, SweepJob.job_id])
                    )
                ids[j["key"]] = jid
        return ids

    def jobs(self, keys: Iterable[str]) -> dict[str, dict[str, Any]]:
        keys = list(keys)
        out: dict[str, dict[str, Any]] = {}
        with self.tx() as c:
            for i in range(0, len(keys), 500):
                for row in c.execute(select(Job).where(Job.key.in_(keys[i : i + 500]))).mappings():
                    out[row["key"]] = dict(row)
        return out

    def claim(self, key: str, owner: str, retry_failed: bool = False) -> bool:
        """Atomically move a job to running for `owner`; False if someone else has it or it is done."""
        allowed = ["pending", "failed"] if retry_failed else ["pending"]
        with self.tx() as c:
            res = c.execute(
                update(Job)
                .where(Job.key == key, Job.status.in_(allowed))
                .values(
                    status="running",
                    owner=owner,
                    started_at=now(),
                    heartbeat_at=now(),
                    error=None,
                    attempts=Job.attempts + 1,
                )
            )
            return res.rowcount == 1

    def heartbeat(self, keys: Iterable[str], owner: str) -> None:
        keys = list(keys)
        if not keys:
            return
        with self.tx() as c:
            c.execute(
                update(Job)
                .where(Job.key.in_(keys), Job.owner == owner, Job.status == "running")
                .values(heartbeat_at=now())
            )

    def release_stale(self, stale_after_s: float = STALE_AFTER_S) -> int:
        """Running jobs whose orchestrator is gone go back to pending (nothing they wrote counts)."""
        released = 0
        with self.tx() as c:
            rows = c.execute(
                select(Job.key, Job.owner, Job.heartbeat_at).where(Job.status == "running")
            ).all()
            for key, owner, beat in rows:
                if owner_dead(owner, beat, stale_after_s):
                    c.execute(
                        update(Job)
                        .where(Job.key == key, Job.status == "running")
                        .values(status="pending", owner=None)
                    )
                    released += 1
        return released

    def release(self, owner: str, key: str | None = None) -> int:
        """Give claimed jobs back untouched (e.g. on Ctrl-C before they finished): one, or every running
        job of `owner` (also one claimed a moment before the interrupt, which its owner may not know of)."""
        cond = [Job.owner == owner, Job.status == "running"] + ([Job.key == key] if key is not None else [])
        with self.tx() as c:
            return c.execute(
                update(Job).where(*cond).values(status="pending", owner=None, attempts=Job.attempts - 1)
            ).rowcount

    def finish(
        self,
        key: str,
        owner: str,
        result: dict[str, Any],
        duration_s: float,
        log_path: str | None = None,
        inputs: dict[str, dict[str, str]] | None = None,
    ) -> bool:
        """Write a job's records and mark it succeeded, in one transaction (idempotent per job).
        `inputs`: the upstream artifacts it read, {upstream job key: {path: content hash}}."""
        with self.tx() as c:
            jid = c.scalar(select(Job.id).where(Job.key == key, Job.owner == owner, Job.status == "running"))
            if jid is None:
                return False
            for table in (Metric, Artifact, PlanRow, LayerDiagnostic, ItemScore):
                c.execute(delete(table).where(table.job_id == jid))
            self._write_records(c, result, job_id=jid)
            c.execute(
                update(Job)
                .where(Job.id == jid)
                .values(
                    status="succeeded",
                    finished_at=now(),
                    duration_s=duration_s,
                    compute_s=result.get("compute_s"),
                    log_path=log_path,
                    versions_json=json.dumps(result.get("versions", {}), sort_keys=True),
                    outputs_json=json.dumps(result.get("outputs", {}), sort_keys=True),
                    inputs_json=None if inputs is None else json.dumps(inputs, sort_keys=True),
                    error=None,
                )
            )
            return True

    # ---- artifacts --------------------------------------------------------------------------
    def artifacts(self, keys: Iterable[str]) -> dict[str, list[dict[str, Any]]]:
        """{job key: its artifact rows} for the given jobs (every key present, [] for none)."""
        keys = list(dict.fromkeys(keys))
        out: dict[str, list[dict[str, Any]]] = {k: [] for k in keys}
        with self.tx() as c:
            for i in range(0, len(keys), 500):
                q = (
                    select(
                        Job.key,
                        Artifact.id,
                        Artifact.kind,
                        Artifact.path,
                        Artifact.content_hash,
                        Artifact.size_bytes,
                        Artifact.mtime,
                    )
                    .join(Job, Job.id == Artifact.job_id)
                    .where(Job.key.in_(keys[i : i + 500]))
                    .order_by(Artifact.id)
                )
                for row in c.execute(q).mappings():
                    out[row["key"]].append(dict(row))
        return out

    def artifact_jobs(self, sweep_id: int | None = None) -> list[dict[str, Any]]:
        """Succeeded jobs that recorded artifacts (of one sweep, or all): key, stage, job id."""
        q = (
            select(Job.key, Job.stage, Job.id)
            .where(Job.status == "succeeded")
            .where(Job.id.in_(select(Artifact.job_id)))
            .order_by(Job.id)
        )
        if sweep_id is not None:
            q = q.where(Job.id.in_(select(SweepJob.job_id).where(SweepJob.sweep_id == sweep_id)))
        with self.tx() as c:
            return [dict(r) for r in c.execute(q).mappings()]

    def update_artifact(self, artifact_id: int, *, mtime: float | None, size_bytes: int | None) -> None:
        """The content is unchanged but its size/mtime fingerprint moved (or was never stored): store it."""
        with self.tx() as c:
            c.execute(
                update(Artifact).where(Artifact.id == artifact_id).values(mtime=mtime, size_bytes=size_bytes)
            )

    def mark_stale(self, key: str, reason: str) -> bool:
        """A succeeded job whose artifact changed, or whose input was recomputed with other content, goes
        back to `pending` with `reason` as its error: the next launch (or this one) recomputes it. Its
        records stay until the recomputation replaces them. False if it was not succeeded (any more)."""
        with self.tx() as c:
            return (
                c.execute(
                    update(Job)
                    .where(Job.key == key, Job.status == "succeeded")
                    .values(status="pending", owner=None, error=f"stale: {reason}"[-4000:])
                ).rowcount
                == 1
            )

    def add_partial_metrics(self, key: str, owner: str, metrics: list[dict[str, Any]]) -> int:
        """Metrics a running job reports before it ends (its final record replaces them in `finish`)."""
        with self.tx() as c:
            jid = c.scalar(select(Job.id).where(Job.key == key, Job.owner == owner, Job.status == "running"))
            if jid is None:
                return 0
            for (
                m
            ) in metrics:  # a re-sent record replaces the earlier copy (unique per name/stage/task/who/step)
                step = -1 if m.get("step") is None else int(m["step"])
                c.execute(
                    delete(Metric).where(
                        Metric.job_id == jid,
                        Metric.name == m["name"],
                        Metric.stage == (m.get("stage") or ""),
                        Metric.task == (m.get("task") or ""),
                        Metric.who == (m.get("who") or ""),
                        Metric.step == step,
                    )
                )
            self._write_records(c, {"metrics": metrics}, job_id=jid)
            return len(metrics)

    def fail(
        self,
        key: str,
        owner: str,
        error: str,
        final: bool,
        log_path: str | None = None,
        duration_s: float | None = None,
    ) -> None:
        with self.tx() as c:
            c.execute(
                update(Job)
                .where(Job.key == key, Job.owner == owner)
                .values(
                    status="failed" if final else "pending",
                    error=error[-4000:],
                    finished_at=now(),
                    log_path=log_path,
                    duration_s=duration_s,
                    owner=owner if final else None,
                )
            )

    @staticmethod
    def _write_records(
        c: Connection, result: dict[str, Any], *, job_id: int | None = None, config_id: int | None = None
    ) -> None:
        metrics = []
        for m in result.get("metrics", []):
            row = {f: m.get(f) for f in METRIC_FIELDS}
            value, kind = classify(m.get("value"))
            row.update(
                value=value,
                value_kind=m.get("value_kind") or kind,
                task=m.get("task") or "",
                stage=m.get("stage") or "",
                who=m.get("who") or "",
                step=-1 if m.get("step") is None else int(m["step"]),
                headline=int(bool(m.get("headline"))),
                job_id=job_id,
                config_id=config_id,
                extra_json=json.dumps(m["extra"], sort_keys=True) if m.get("extra") else None,
            )
            metrics.append(row)
        if metrics:
            c.execute(insert(Metric), metrics)
        if job_id is None:
            return
        for table, name in ((Artifact, "artifacts"), (PlanRow, "plan_rows"), (LayerDiagnostic, "layer_diag")):
            rows = [dict(r, job_id=job_id) for r in result.get(name, [])]
            if rows:
                c.execute(insert(table), rows)
        items = [dict(item_row(r), job_id=job_id) for r in result.get("item_scores", [])]
        if items:
            c.execute(insert(ItemScore), items)

    # ---- configurations -------------------------------------------------------------------
    def upsert_configs(self, sweep_id: int, configs: Iterable[dict[str, Any]]) -> dict[str, int]:
        ids: dict[str, int] = {}
        with self.tx() as c:
            for cfg in configs:
                values = {f: cfg.get(f) for f in CONFIG_FIELDS if f in cfg}
                cid = c.scalar(
                    select(Configuration.id).where(
                        Configuration.sweep_id == sweep_id, Configuration.config_key == cfg["config_key"]
                    )
                )
                if (
                    cid is not None
                ):  # the common case first: PostgreSQL's ON CONFLICT spends a sequence number
                    c.execute(update(Configuration).where(Configuration.id == cid).values(**values))
                    ids[cfg["config_key"]] = cid
                    continue
                stmt = _upsert(c, Configuration).values(
                    sweep_id=sweep_id, config_key=cfg["config_key"], **values
                )
                ids[cfg["config_key"]] = c.scalar(
                    stmt.on_conflict_do_update(
                        index_elements=[Configuration.sweep_id, Configuration.config_key],
                        set_=values or {"config_key": stmt.excluded.config_key},
                    ).returning(Configuration.id)
                )
        return ids

    def link(self, links: Iterable[tuple[int, str, int]]) -> None:
        """(config_id, stage, job_id): which job produced a configuration's numbers for a stage."""
        with self.tx() as c:
            # one atomic upsert per link: two launches linking the same configuration at once (a select, then
            # an insert) both saw no row and the second insert broke the unique (config_id, stage)
            for config_id, stage, job_id in links:
                stmt = _upsert(c, ConfigJob).values(config_id=config_id, stage=stage, job_id=job_id)
                c.execute(
                    stmt.on_conflict_do_update(
                        index_elements=[ConfigJob.config_id, ConfigJob.stage],
                        set_={"job_id": stmt.excluded.job_id},
                    )
                )

    def unlink(self, config_ids: Iterable[int], stage: str) -> int:
        """Forget which job produced these configurations' numbers for a stage (the job itself stays):
        e.g. a configuration that an earlier selection distilled and the current one does not."""
        ids = list(config_ids)
        n = 0
        with self.tx() as c:
            for i in range(0, len(ids), 500):
                n += c.execute(
                    delete(ConfigJob).where(
                        ConfigJob.config_id.in_(ids[i : i + 500]), ConfigJob.stage == stage
                    )
                ).rowcount
        return n

    def set_config_fields(self, updates: dict[int, dict[str, Any]]) -> None:
        with self.tx() as c:
            for cid, values in updates.items():
                c.execute(update(Configuration).where(Configuration.id == cid).values(**values))

    def configs(self, sweep_id: int) -> list[dict[str, Any]]:
        with self.tx() as c:
            return [
                dict(r)
                for r in c.execute(
                    select(Configuration).where(Configuration.sweep_id == sweep_id).order_by(Configuration.id)
                ).mappings()
            ]

    # ---- reading ----------------------------------------------------------------------------
    def query(self, sql: str, params: dict[str, Any] | None = None) -> tuple[list[str], list[tuple]]:
        """Run one statement. On a read-only store nothing is ever committed and every error is one
        StoreError (a refused write says so); on PostgreSQL it must be a query (SELECT, WITH, VALUES, TABLE,
        SHOW, EXPLAIN) that calls no function touching the server's files or the session's role."""
        if self.read_only and self.engine.dialect.name == "postgresql":
            why = pg_refusal(sql)
            if why is not None:
                raise StoreError(why)
        if not self.read_only:
            with self.engine.connect() as c:
                res = c.execute(text(sql), params or {})
                if not res.returns_rows:
                    c.commit()
                    return [], []
                return list(res.keys()), [tuple(r) for r in res.all()]
        try:
            with self.engine.connect() as c:
                try:
                    res = c.execute(text(sql), params or {})
                    if not res.returns_rows:
                        return [], []
                    return list(res.keys()), [tuple(r) for r in res.all()]
                finally:
                    c.rollback()
        except DBAPIError as e:
            if unusable(e):
                raise StoreError(explain(self.url, e, True)) from None
            raise StoreError(refusal(sql, e) or " ".join(str(e.orig).split())) from None
        except SQLAlchemyError as e:  # raised before the database sees it, e.g. a `:name` with no value
            msg = re.sub(r"^\(sqlalchemy[\w.]*\) ", "", str(e).splitlines()[0])
            if "bind parameter" in msg and not params:
                msg += " (write the value into the query: a :name is a parameter)"
            raise StoreError(msg) from None

    def job_counts(self, sweep_id: int) -> dict[tuple[str, str], int]:
        with self.tx() as c:
            rows = c.execute(
                select(Job.stage, Job.status, func.count())
                .join(SweepJob, SweepJob.job_id == Job.id)
                .where(SweepJob.sweep_id == sweep_id)
                .group_by(Job.stage, Job.status)
            ).all()
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
                sid = self._upsert_sweep(
                    c,
                    sw["name"],
                    description=sw.get("description"),
                    kind="reference",
                    source=sw.get("source", "paper"),
                    spec_yaml=None,
                    spec_hash=None,
                    select_json=json.dumps(rule, sort_keys=True) if rule else None,
                )
                c.execute(delete(Configuration).where(Configuration.sweep_id == sid))
                ids: dict[str, int] = {}
                for i, cfg in enumerate(sw["configs"]):
                    values = {f: cfg.get(f) for f in CONFIG_FIELDS if f in cfg}
                    values.setdefault("source_table", cfg.get("table"))
                    key = cfg.get("config_key") or f"{cfg.get('table', 'ref')}:{i}"
                    ids[key] = c.execute(
                        insert(Configuration).values(sweep_id=sid, config_key=key, **values)
                    ).inserted_primary_key[0]
                    self._write_records(c, {"metrics": cfg.get("metrics", [])}, config_id=ids[key])
                for i, cfg in enumerate(sw["configs"]):
                    main = cfg.get("variant_of_key")
                    if main is None:
                        continue
                    key = cfg.get("config_key") or f"{cfg.get('table', 'ref')}:{i}"
                    if main not in ids or main == key:
                        raise ValueError(
                            f"reference sweep {sw['name']!r}, configuration {key!r}: "
                            f"variant_of_key {main!r} is not another configuration of the "
                            "sweep; allowed: its other config_keys"
                        )
                    c.execute(
                        update(Configuration).where(Configuration.id == ids[key]).values(variant_of=ids[main])
                    )
                counts[sw["name"]] = len(sw["configs"])
        return counts


URL_EXAMPLES = "sqlite:///PATH or postgresql+psycopg://USER@HOST/DB"
# PRAGMAs a read-only connection may run: these only report (never with a value, `PRAGMA x=...`)...
READ_PRAGMAS = frozenset(
    {
        "application_id",
        "auto_vacuum",
        "busy_timeout",
        "cache_size",
        "collation_list",
        "compile_options",
        "data_version",
        "database_list",
        "encoding",
        "foreign_keys",
        "freelist_count",
        "function_list",
        "journal_mode",
        "module_list",
        "page_count",
        "page_size",
        "pragma_list",
        "query_only",
        "read_uncommitted",
        "schema_version",
        "synchronous",
        "user_version",
    }
)
# ...and these take a table, index or row limit as their argument and still only report
ARG_PRAGMAS = frozenset(
    {
        "foreign_key_check",
        "foreign_key_list",
        "index_info",
        "index_list",
        "index_xinfo",
        "integrity_check",
        "quick_check",
        "table_info",
        "table_list",
        "table_xinfo",
    }
)
# statements that change something: when one fails on a read-only store, it was refused (VACUUM, say,
# fails as "cannot VACUUM from within a transaction" before SQLite asks the authorizer)
WRITING_KEYWORDS = frozenset(
    {
        "ALTER",
        "ANALYZE",
        "ATTACH",
        "CLUSTER",
        "COMMENT",
        "COPY",
        "CREATE",
        "DELETE",
        "DETACH",
        "DROP",
        "GRANT",
        "INSERT",
        "MERGE",
        "REFRESH",
        "REINDEX",
        "RELEASE",
        "REPLACE",
        "REVOKE",
        "SAVEPOINT",
        "TRUNCATE",
        "UPDATE",
        "UPSERT",
        "VACUUM",
    }
)
UNSAFE_FUNCTIONS = frozenset({"load_extension", "fts3_tokenizer"})
# PostgreSQL: the statements a reader may run...
PG_QUERIES = frozenset({"SELECT", "WITH", "VALUES", "TABLE", "SHOW", "EXPLAIN"})
# ...and the functions it may not call: they read or write the server's files or signal its processes,
# run SQL text of their own, or change the session's role (a query that set its role back would lift
# the restriction below); U&"..." spells an identifier in escapes, which would hide a name from this list
PG_REFUSED = re.compile(
    r"\b(set_config|query_to_xml\w*|cursor_to_xml\w*|ts_stat|ts_rewrite|lo_import|lo_export"
    r"|pg_read_file|pg_read_binary_file|pg_ls_\w+|pg_stat_file|pg_file_\w+|pg_logdir_ls|dblink\w*"
    r"|pg_reload_conf|pg_rotate_logfile\w*|pg_terminate_backend|pg_cancel_backend|pg_switch_wal"
    r"|pg_promote|pg_create_restore_point|pg_backup_start|pg_backup_stop|pg_\w*replication\w*)\b"
    r"|\bu&[\"']",
    re.IGNORECASE,
)
# the login's rights that let SQL read or write the server's files or run programs there
PG_PRIVILEGED_ROLES = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")
READER_ROLE = "moesweep_reader"  # what a reader with those rights reads as: SELECT on the schema, no more
_LEADING = re.compile(r"(?:\s+|--[^\n]*|/\*.*?\*/|\()*", re.DOTALL)
_READING = frozenset(
    {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        sqlite3.SQLITE_RECURSIVE,
        sqlite3.SQLITE_TRANSACTION,
    }
)


def read_only_authorizer(
    action: int, arg1: str | None, arg2: str | None, _db: str | None, _trigger: str | None
) -> int:
    """sqlite3 authorizer of a read-only connection: reading, functions, BEGIN/COMMIT/ROLLBACK, the
    reporting PRAGMAs and their table-valued functions (`SELECT name FROM pragma_table_info('jobs')`);
    everything else (writes, DDL, ATTACH/DETACH, VACUUM, REINDEX, ANALYZE, SAVEPOINT, PRAGMA x=value,
    load_extension) is denied when the statement is prepared."""
    if action == sqlite3.SQLITE_UPDATE and arg1 == "sqlite_master":
        # SQLite asks this while it sets up a table-valued function (pragma_table_info, json_each); a
        # real UPDATE of the schema table also needs PRAGMA writable_schema=ON, denied below, and
        # query_only and mode=ro refuse it as well
        return sqlite3.SQLITE_OK
    if action in _READING:
        return (
            sqlite3.SQLITE_DENY
            if action == sqlite3.SQLITE_FUNCTION and arg2 in UNSAFE_FUNCTIONS
            else sqlite3.SQLITE_OK
        )
    if action == sqlite3.SQLITE_PRAGMA:
        name = (arg1 or "").lower()
        if name in ARG_PRAGMAS or (name in READ_PRAGMAS and arg2 is None):
            return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


def parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except ArgumentError:
        raise StoreError(f"{url!r} is not a database URL; expected {URL_EXAMPLES}", about_url=True) from None


def shown_url(url: str) -> str:
    """The URL as messages show it: a SQLite file as its path, never a password."""
    try:
        u = make_url(url)
    except ArgumentError:
        return url
    if u.get_backend_name() == "sqlite":
        return u.database or ":memory:"
    return u.render_as_string(hide_password=True)


def sqlite_path(u: URL) -> Path | None:
    """The file of a SQLite URL; None for an in-memory database."""
    db = u.database
    if not db or db == ":memory:" or db.startswith("file:") and "mode=memory" in db:
        return None
    return Path(db[5:].split("?", 1)[0] if db.startswith("file:") else db)


def first_keyword(sql: str) -> str:
    """The statement's first word, upper-case, after comments, blanks and opening parentheses."""
    m = re.match(r"[A-Za-z_]+", sql[_LEADING.match(sql).end() :])
    return m.group(0).upper() if m else ""


def pg_refusal(sql: str) -> str | None:
    """Why a PostgreSQL reader refuses `sql` (one line), or None: only queries, and no function that
    reaches out of the database or changes the session."""
    head = textwrap.shorten(" ".join(sql.split()), 60, placeholder=" …")
    first = first_keyword(sql)
    if first not in PG_QUERIES:
        return (
            f"refused {head!r}: moesweep sql only reads: {first or 'it'} is not a query; allowed: "
            f"{', '.join(sorted(PG_QUERIES))} (nothing was run)"
        )
    m = PG_REFUSED.search(sql)
    if m:
        return (
            f"refused {head!r}: a reader may not call {m.group(0)!r} (it reaches the server's files or "
            "processes, runs SQL of its own or changes the session's role); nothing was run"
        )
    return None


def unusable(e: DBAPIError) -> bool:
    """Whether a database error means the file itself cannot be used: damaged, or not writable."""
    msg = str(e.orig).lower()
    return any(w in msg for w in ("malformed", "file is not a database", "readonly database"))


def explain(url: str, e: BaseException, read_only: bool = False) -> str:
    """One line for a database that cannot be opened or used: what, where, and what to do."""
    where = shown_url(url)
    if isinstance(e, DBAPIError) and e.orig is not None:
        msg = " ".join(str(e.orig).split())
    else:
        msg = " ".join(str(e).split("\n[SQL")[0].split())
    low = msg.lower()
    if isinstance(e, OSError):
        return f"{where}: cannot create or open it: {e.strerror or msg}" + (
            f" ({e.filename})" if getattr(e, "filename", None) else ""
        )
    if "unable to open database file" in low:
        if read_only:
            return f"{where}: cannot open the database file for reading (may you read it?)"
        return f"{where}: cannot open or create the database file (does its folder exist, may you write it?)"
    if "readonly database" in low:
        return f"{where}: the database or its folder is read-only; it cannot be written"
    if "file is not a database" in low:
        return f"{where} is not a SQLite database"
    if "malformed" in low:
        return (
            f"{where} is a damaged SQLite database ({msg}): restore it from a backup (`sqlite3 {where} "
            "'.recover'` may save what is left)"
        )
    if "database is locked" in low:
        return f"{where} is locked by another process (gave up after 30 s); try again when it is done"
    if "connection" in low and any(w in low for w in ("refused", "failed", "timeout", "timed out")):
        return f"cannot connect to {where}: {msg}"
    return f"{where}: {msg}"


def refusal(sql: str, e: DBAPIError) -> str | None:
    """The one-line message when a read-only connection refuses a statement; None for other errors."""
    msg = " ".join(str(e.orig).split()).lower()
    head = textwrap.shorten(" ".join(sql.split()), 60, placeholder=" …")
    if "one statement at a time" in msg or "multiple commands" in msg:
        return (
            f"one statement at a time: {head!r} holds several; moesweep sql runs a single SELECT or "
            "WITH query (nothing was changed)"
        )
    code = getattr(e.orig, "sqlstate", None)
    first = first_keyword(sql)
    refused = (
        "not authorized",
        "authorization denied",
        "readonly database",
        "query_only",
        "read-only transaction",
        "read-write mode",
    )
    if code == "25006" or any(r in msg for r in refused) or first in WRITING_KEYWORDS:
        return (
            f"refused {head!r}: the database is open read-only; moesweep sql only reads (SELECT, WITH, "
            "reporting PRAGMAs), no writes, DDL, ATTACH, VACUUM or PRAGMA changes (nothing was changed)"
        )
    return None


def make_engine(url: str, read_only: bool = False, create: bool = True) -> Engine:
    """An engine for `url`; StoreError (one line) for a malformed URL, a missing driver or, read-only or
    with `create=False`, a database that does not exist. Read-write SQLite creates the database's folder."""
    u = parse_url(url)
    backend = u.get_backend_name()
    try:
        driver = u.get_driver_name()
    except NoSuchModuleError:
        driver = None
    unknown = StoreError(
        f"{u.render_as_string(hide_password=True)!r}: unknown or unsupported database kind "
        f"or driver {u.drivername!r}; expected {URL_EXAMPLES} (or another SQLAlchemy "
        "dialect)",
        about_url=True,
    )
    if driver is None or backend == "sqlite" and driver != "pysqlite":
        raise unknown
    if backend == "sqlite":
        return _sqlite_engine(url, u, read_only, create)
    if read_only and (backend, driver) != ("postgresql", "psycopg"):
        raise StoreError(
            f"{shown_url(url)}: read-only access needs SQLite or PostgreSQL through psycopg: "
            "write the URL as sqlite:///PATH or postgresql+psycopg://…",
            about_url=True,
        )
    args = (
        {"connect_timeout": 10}
        if driver in ("psycopg", "psycopg2") and "connect_timeout" not in u.query
        else {}
    )
    try:
        engine = create_engine(u, pool_pre_ping=True, connect_args=args)
    except NoSuchModuleError:
        raise unknown from None
    except ImportError as e:
        if backend != "postgresql":
            raise StoreError(
                f"{shown_url(url)}: the {backend} driver {e.name or driver} is not installed "
                f"(pip install {e.name or driver})"
            ) from None
        hint = "" if driver == "psycopg" else " and write the URL as postgresql+psycopg://…"
        raise StoreError(
            f"{shown_url(url)}: the PostgreSQL driver {e.name or driver} is not installed: "
            f"pip install 'moesweep[postgres]'{hint}"
        ) from None
    if read_only:
        _pg_read_only(engine)
    return engine


def _pg_read_only(engine: Engine) -> None:
    """Every transaction read-only, its mode fixed before the caller's statement (SET TRANSACTION READ
    WRITE is then refused); statements are prepared, so one call cannot smuggle in a COMMIT and a second
    statement. A login that may touch the server's files reads as READER_ROLE (`_restrict`)."""

    @event.listens_for(engine, "connect")
    def _session(dbapi_conn, _record) -> None:
        _restrict(dbapi_conn, engine.url.render_as_string(hide_password=True))
        with dbapi_conn.cursor() as cur:
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        dbapi_conn.commit()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:
        conn.exec_driver_sql("SET TRANSACTION READ ONLY")
        conn.exec_driver_sql("SELECT 1")  # takes the snapshot: the mode can no longer change

    @event.listens_for(engine, "do_execute")
    def _execute(cursor, statement, parameters, _context) -> bool:
        cursor.execute(statement, parameters, prepare=True)
        return True

    @event.listens_for(engine, "do_execute_no_params")
    def _execute_no_params(cursor, statement, _context) -> bool:
        cursor.execute(statement, prepare=True)
        return True


_PRIVILEGED_SQL = "SELECT current_user, rolsuper{} FROM pg_roles WHERE rolname = current_user".format(
    "".join(f" OR pg_has_role(current_user, '{r}', 'MEMBER')" for r in PG_PRIVILEGED_ROLES)
)


# whether the reader role may already use the schema and read every table and view in it
_GRANTED_SQL = (
    "SELECT has_schema_privilege(%(r)s, %(s)s, 'USAGE') AND coalesce(bool_and(has_table_privilege(%(r)s, "
    "c.oid, 'SELECT')), true) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = %(s)s AND c.relkind IN ('r', 'v', 'm', 'p', 'f')"
)


def _restrict(conn: Any, where: str) -> None:
    """A reader's PostgreSQL session whose login may read or write the server's files or run programs
    there (a superuser, say: COPY ... TO PROGRAM, pg_read_file) continues as READER_ROLE (SET ROLE), a
    role that cannot log in and may only read the current schema's tables and views. The login creates
    the role and grants it what it lacks (a superuser may); else the reader is refused in one line."""
    import psycopg
    from psycopg import sql

    with conn.cursor() as cur:
        user, privileged = cur.execute(_PRIVILEGED_SQL).fetchone()
        if not privileged:
            conn.commit()
            return
        role = sql.Identifier(READER_ROLE)
        for attempt in (1, 2, 3):  # two readers creating the role or granting at once: the second retries
            try:
                if not cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [READER_ROLE]).fetchall():
                    cur.execute(sql.SQL("CREATE ROLE {} NOLOGIN NOINHERIT").format(role))
                schema = cur.execute("SELECT current_schema()").fetchone()[0]
                if (
                    schema is not None
                    and not cur.execute(_GRANTED_SQL, {"r": READER_ROLE, "s": schema}).fetchone()[0]
                ):
                    for grant in (
                        "GRANT USAGE ON SCHEMA {} TO {}",
                        "GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}",
                    ):
                        cur.execute(sql.SQL(grant).format(sql.Identifier(schema), role))
                cur.execute(sql.SQL("SET ROLE {}").format(role))
                still = cur.execute(_PRIVILEGED_SQL).fetchone()[1]
                conn.commit()
                break
            except psycopg.Error as e:
                conn.rollback()
                if attempt == 3 or isinstance(e, psycopg.errors.InsufficientPrivilege):
                    raise StoreError(
                        f"{where}: the role {user!r} may read or write the server's files or run "
                        f"programs there (superuser, or {', '.join(PG_PRIVILEGED_ROLES)}), and cannot read "
                        f"through the restricted role {READER_ROLE} ({' '.join(str(e).split())}); read as "
                        "a role without those rights: CREATE ROLE r LOGIN; GRANT USAGE ON SCHEMA public TO "
                        "r; GRANT SELECT ON ALL TABLES IN SCHEMA public TO r; then "
                        "--db postgresql+psycopg://r@HOST/DB"
                    ) from None
    if still:
        raise StoreError(
            f"{where}: the role {READER_ROLE} that moesweep reads through may itself read or write the "
            f"server's files (superuser, or {', '.join(PG_PRIVILEGED_ROLES)}): revoke that, e.g. "
            f"ALTER ROLE {READER_ROLE} NOSUPERUSER"
        )


def _writable(path: Path) -> bool:
    """Whether this process may write `path` (a file, or a folder to create files in)."""
    return os.access(path, os.W_OK, effective_ids=os.access in os.supports_effective_ids)


def _stat(path: Path) -> os.stat_result | None:
    """The database file's status, None where there is none; a path that cannot be used is one StoreError."""
    try:
        return path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            longest = max(len(os.fsencode(part)) for part in path.parts)
            raise StoreError(
                f"{path}: the path is too long for the file system (its longest name has {longest} "
                "bytes; allowed: at most 255 bytes a name, 4096 in all); choose a shorter one"
            ) from None
        raise StoreError(f"{path}: cannot use it: {e.strerror}") from None


_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _sqlite_engine(url: str, u: URL, read_only: bool, create: bool = True) -> Engine:
    if u.host or u.username or u.port:
        rest = "/".join(p for p in (u.host, u.database) if p)
        raise StoreError(
            f"{url!r}: a SQLite URL names no host; a path follows three slashes, sqlite:///{rest} "
            "(four for an absolute path, sqlite:////abs/path/x.db)",
            about_url=True,
        )
    path = sqlite_path(u)
    if path is None:
        if read_only:
            raise StoreError(
                f"{url!r}: an in-memory database cannot be opened read-only; give a file, sqlite:///PATH",
                about_url=True,
            )
        raise StoreError(
            f"{url!r}: an in-memory database keeps nothing once the command ends (a launch would run and "
            "leave no results); give a file, sqlite:///PATH",
            about_url=True,
        )
    if "\0" in str(path):
        raise StoreError(
            f"{url!r}: the path holds a NUL character (%00), which no file name may hold", about_url=True
        )
    st = _stat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path} is a folder, not a database file")
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise StoreError(f"{path} is {kind}, not a database file; a SQLite database is a regular file")
    if st is None and (read_only or not create):
        raise StoreError(f"no database at {path} (moesweep launch or moesweep migrate creates one)")
    if read_only:
        return _sqlite_reader(u, path)
    readers = "moesweep sql, status, report and serve only read it"
    if st is not None and not _writable(path):
        raise StoreError(
            f"{path} is read-only (may you write it?): this command writes the database; {readers}"
        )
    if st is not None and not _writable(path.parent):
        raise StoreError(
            f"{path}: its folder {path.parent} is read-only (may you write it?): SQLite writes the "
            f"database's -wal and -shm files there; {readers}"
        )
    if create:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreError(f"{path}: cannot create it: {path.parent} is a file, not a folder") from None
        except OSError as e:
            raise StoreError(f"{path}: cannot create its folder {path.parent}: {e.strerror}") from None
    engine = create_engine(u, connect_args={"timeout": 30, "isolation_level": None})

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


def _sqlite_reader(u: URL, path: Path) -> Engine:
    """A read-only engine (`mode=ro`, `query_only`, the authorizer) that leaves no file behind.

    A WAL database needs its -shm (and -wal) file to be read; a `mode=ro` connection creates them where
    they are missing but never deletes them (only a connection that may write does, when it is the last
    to close). So: in a folder this process cannot write, with no -shm there (no launch is writing), each
    connection reads the file as `immutable=1`, which needs neither file, and connections are not kept
    (the next one looks again); else, where this reader found neither file, disposing of the engine opens
    and closes one plain connection, and SQLite removes them if no one else has the database open."""
    side = Path(f"{path}-wal"), Path(f"{path}-shm")
    base = path.resolve().as_uri()
    folder_writable = _writable(path.parent)

    def connect() -> sqlite3.Connection:
        uri = f"{base}?mode=ro"
        if not folder_writable and not side[1].exists():
            if side[0].exists() and side[0].stat().st_size > 0:
                raise StoreError(
                    f"{path}: its {side[0].name} holds changes not yet in the database file, and SQLite "
                    f"cannot read them without creating {side[1].name} in {path.parent}, a folder you may "
                    "not write: open it once with write access (e.g. moesweep migrate), or copy the folder"
                )
            uri += "&immutable=1"
        conn = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA query_only=ON")
        conn.set_authorizer(read_only_authorizer)  # last: the PRAGMA above needs no permission
        return conn

    engine = create_engine(u, creator=connect, **({} if folder_writable else {"poolclass": NullPool}))

    @event.listens_for(engine, "begin")
    def _begin_deferred(conn) -> None:
        conn.exec_driver_sql("BEGIN")  # BEGIN IMMEDIATE would take a write lock

    if folder_writable and not any(p.exists() for p in side):

        @event.listens_for(engine, "engine_disposed")
        def _tidy(_engine) -> None:
            if not any(p.exists() for p in side):
                return
            try:
                conn = sqlite3.connect(f"{base}?mode=rw", uri=True, timeout=0)
                try:
                    conn.execute("PRAGMA query_only=ON")
                    conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
                finally:
                    conn.close()
            except sqlite3.Error:
                pass  # in use or not writable: whoever writes it removes them

    return engine
