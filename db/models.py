"""SQLAlchemy models of the results database, matching the head migration (db/migrations).

Jobs are content-addressed and shared between configurations and sweeps; configurations point
to the jobs that produced their numbers through `config_jobs`. Metrics of our own runs belong to
a job; metrics imported from a paper belong directly to a configuration.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Sweep(Base):
    __tablename__ = "sweeps"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    kind: Mapped[str] = mapped_column(String(20), default="own")  # own | reference
    source: Mapped[str] = mapped_column(String(200), default="moesweep")
    description: Mapped[str | None] = mapped_column(Text)
    spec_yaml: Mapped[str | None] = mapped_column(Text)
    spec_hash: Mapped[str | None] = mapped_column(String(64))
    # the selection rule between stages: {"best_by": "ppl_pre", "per": [...], "over": [...]}; NULL: none
    select_json: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(server_default=text("CURRENT_TIMESTAMP"))
    updated_at: Mapped[datetime | None]


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(64), unique=True)
    stage: Mapped[str] = mapped_column(String(40), index=True)
    params_json: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(20), default="pending", index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    owner: Mapped[str | None] = mapped_column(String(200))
    heartbeat_at: Mapped[datetime | None]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    duration_s: Mapped[float | None] = mapped_column(Float)  # wall time seen by the orchestrator
    compute_s: Mapped[float | None] = mapped_column(Float)  # time inside the worker function
    error: Mapped[str | None] = mapped_column(Text)
    log_path: Mapped[str | None] = mapped_column(Text)
    code_version: Mapped[str | None] = mapped_column(String(100))  # short hash of all code components
    code_json: Mapped[str | None] = mapped_column(Text)  # {component: hash} of the code that computed it
    versions_json: Mapped[str | None] = mapped_column(Text)  # library versions, backend, device
    outputs_json: Mapped[str | None] = mapped_column(Text)  # plain outputs read by later stages
    # what it read: {upstream job key: {artifact path: content hash}} (NULL: recorded before 0003)
    inputs_json: Mapped[str | None] = mapped_column(Text)


class StageOrder(Base):
    """The order a launch runs its stages in, as the orchestrator last recorded it (readers order stages
    by it instead of importing the orchestrator's registry)."""

    __tablename__ = "stages"
    name: Mapped[str] = mapped_column(String(40), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)


class SweepJob(Base):
    __tablename__ = "sweep_jobs"
    __table_args__ = (UniqueConstraint("sweep_id", "job_id"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)


class Configuration(Base):
    """One row of a sweep's grid (or a baseline / the teacher), with typed axes."""

    __tablename__ = "configurations"
    __table_args__ = (UniqueConstraint("sweep_id", "config_key"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    sweep_id: Mapped[int] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"), index=True)
    config_key: Mapped[str] = mapped_column(String(200))
    model: Mapped[str] = mapped_column(String(200))
    teacher_variant: Mapped[str | None] = mapped_column(String(50))
    family: Mapped[str | None] = mapped_column(String(50))
    kind: Mapped[str] = mapped_column(String(20))  # moe2dense | moe2moe | dense2moe | baseline | teacher
    baseline: Mapped[str | None] = mapped_column(String(200))
    scoring: Mapped[str | None] = mapped_column(String(50), index=True)
    grouping: Mapped[str | None] = mapped_column(String(50), index=True)
    dp_scaling: Mapped[str | None] = mapped_column(String(50))
    K: Mapped[int | None] = mapped_column(Integer)
    output: Mapped[str | None] = mapped_column(
        String(20)
    )  # dense | moe | merged | edited (NULL: dense, before 0004)
    recovery: Mapped[str | None] = mapped_column(String(50))  # none | router_kd | full_kd (smaller MoEs)
    merging: Mapped[str | None] = mapped_column(String(50))  # merged outputs: HC-SMoE | M-SMoE
    editing: Mapped[str | None] = mapped_column(String(50))  # edited outputs: MoBE | TD-MoE
    settings: Mapped[str | None] = mapped_column(Text)  # JSON: the settings of its output and method
    top_k: Mapped[int | None] = mapped_column(
        Integer
    )  # the router's k (= groups); SQLite names are case-blind
    distill_loss: Mapped[str | None] = mapped_column(String(50))
    teacher_top_k: Mapped[int | None] = mapped_column(Integer)
    distill_tokens: Mapped[str | None] = mapped_column(String(50))
    source_table: Mapped[str | None] = mapped_column(String(50))
    selected_for_distill: Mapped[int] = mapped_column(Integer, default=0)
    duplicate_of: Mapped[int | None] = mapped_column(ForeignKey("configurations.id"))
    variant: Mapped[str | None] = mapped_column(String(200))  # e.g. loss=reverse_kl; NULL: a main config
    variant_of: Mapped[int | None] = mapped_column(ForeignKey("configurations.id"))  # the main config varied
    plan_key: Mapped[str | None] = mapped_column(String(64))
    note: Mapped[str | None] = mapped_column(Text)


class ConfigJob(Base):
    __tablename__ = "config_jobs"
    __table_args__ = (UniqueConstraint("config_id", "stage"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    config_id: Mapped[int] = mapped_column(ForeignKey("configurations.id", ondelete="CASCADE"), index=True)
    stage: Mapped[str] = mapped_column(String(40))
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)


class Metric(Base):
    """One number with its raw sufficient statistics and how it was obtained."""

    __tablename__ = "metrics"
    __table_args__ = (
        Index(
            "uq_metric_job",
            "job_id",
            "name",
            "stage",
            "task",
            "who",
            "step",
            unique=True,
            sqlite_where=text("job_id IS NOT NULL"),
            postgresql_where=text("job_id IS NOT NULL"),
        ),
        Index(
            "uq_metric_config",
            "config_id",
            "name",
            "stage",
            "task",
            "who",
            "step",
            unique=True,
            sqlite_where=text("config_id IS NOT NULL"),
            postgresql_where=text("config_id IS NOT NULL"),
        ),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    config_id: Mapped[int | None] = mapped_column(ForeignKey("configurations.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(50))  # ppl, acc, acc_norm, val_ce, train_loss, ...
    stage: Mapped[str] = mapped_column(String(20), default="")  # pre | post | train | calib | ''
    task: Mapped[str] = mapped_column(String(100), default="")
    who: Mapped[str] = mapped_column(String(20), default="")  # student | teacher | random_init | ''
    step: Mapped[int] = mapped_column(Integer, default=-1)
    value: Mapped[float | None] = mapped_column(Float)
    value_kind: Mapped[str] = mapped_column(String(10), default="finite")  # finite | inf | nan
    sum_nll: Mapped[float | None] = mapped_column(Float)
    n_tokens: Mapped[int | None] = mapped_column(Integer)
    correct: Mapped[float | None] = mapped_column(Float)
    total: Mapped[int | None] = mapped_column(Integer)
    stderr: Mapped[float | None] = mapped_column(Float)
    num_fewshot: Mapped[int | None] = mapped_column(Integer)
    headline: Mapped[int] = mapped_column(Integer, default=0)
    extra_json: Mapped[str | None] = mapped_column(Text)  # protocol / eval settings / backend


class ItemScore(Base):
    """Per-item scores behind a metric (db/items.py packs them): lm-eval's per-sample metrics and choice
    log-likelihoods keyed by doc_id (task = the suite's label, subtask = lm-eval's leaf task), or a
    perplexity's per-window Σ NLL (`nll`) and scored tokens (`tokens`) keyed by window (task '')."""

    __tablename__ = "item_scores"
    __table_args__ = (UniqueConstraint("job_id", "stage", "task", "subtask", "step", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    stage: Mapped[str] = mapped_column(String(20), default="")
    task: Mapped[str] = mapped_column(String(100), default="")
    subtask: Mapped[str] = mapped_column(String(200), default="")
    step: Mapped[int] = mapped_column(Integer, default=-1)
    name: Mapped[str] = mapped_column(String(50))  # acc, acc_norm, loglik, nll, tokens, ...
    n: Mapped[int] = mapped_column(Integer)  # entries (items; loglik: choices)
    ids: Mapped[bytes] = mapped_column(LargeBinary)  # zlib(int64 LE): doc_id / window index
    vals: Mapped[bytes] = mapped_column(LargeBinary)  # zlib(float64 LE)


class Artifact(Base):
    __tablename__ = "artifacts"
    __table_args__ = (UniqueConstraint("job_id", "kind", "path"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(50))
    path: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str | None] = mapped_column(String(64))
    size_bytes: Mapped[int | None] = mapped_column(Integer)  # of a folder: its files together
    mtime: Mapped[float | None] = mapped_column(Float)  # seconds; of a folder: the latest in it


class PlanRow(Base):
    """Per layer and kept expert: score, order of selection, group, merge weight and α."""

    __tablename__ = "plan_rows"
    __table_args__ = (UniqueConstraint("job_id", "layer", "expert"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    layer: Mapped[int] = mapped_column(Integer)
    expert: Mapped[int] = mapped_column(Integer)
    score: Mapped[float | None] = mapped_column(Float)
    selected_rank: Mapped[int] = mapped_column(Integer)
    group_idx: Mapped[int] = mapped_column(Integer)
    merge_weight: Mapped[float] = mapped_column(Float)
    alpha: Mapped[float] = mapped_column(Float)


class LayerDiagnostic(Base):
    __tablename__ = "layer_diag"
    __table_args__ = (UniqueConstraint("job_id", "layer", "name"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    layer: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(50))
    value: Mapped[float | None] = mapped_column(Float)
