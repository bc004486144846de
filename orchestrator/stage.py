"""The stage registry: each stage of a sweep is declared once, as a `Stage`.

A declaration names the stage, its section of the sweep file (a pydantic model), the stages whose
outputs its jobs read, its default resources, the worker function that runs one job, which kinds of
records a job may return, and how its jobs are planned from the sweep and from earlier outputs.
Planning, launch, dry run, status and the CLI iterate the registry; none lists stages by hand.

Adding a stage: one module in orchestrator/stages/ with `STAGE = Stage(...)`, listed in
orchestrator/stages/__init__.py (or `register(STAGE)` from anywhere), plus its test.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from orchestrator.schema import Resources
from workers.core.shape import TeacherShape

# item_scores: per-item scores (lm-eval samples, perplexity windows) behind a metric's standard error
RECORD_KINDS = frozenset({"outputs", "metrics", "artifacts", "plan_rows", "layer_diag", "item_scores"})
LIBS = ("torch", "transformers", "lm_eval")


@dataclass(frozen=True, eq=False)
class Stage:
    name: str
    run: str | Callable[..., dict]  # "module:function" (resolved in the worker), or the function
    jobs: Callable[[SweepContext], dict[str, JobSpec]]  # config_key (or a label) → its job
    section: str | None = None  # its section of the sweep file …
    params: type[BaseModel] | None = None  # … and that section's model
    section_default: str = "optional"  # "required" | "optional" (None when absent) | "default" (model())
    upstream: tuple[str, ...] = ()  # stages that run before it and whose outputs its jobs may read
    resources: Resources = field(default_factory=Resources)
    records: frozenset[str] = frozenset({"outputs", "metrics"})
    shared: bool = False  # one job serves many configurations by design (teacher, calibration)
    identity: bool = False  # configurations sharing this stage's job are one student (duplicate_of)
    summary: str = ""
    # the dry run's note on the planned jobs (else summary)
    describe: Callable[[SweepContext], str] | None = None
    static: bool = False  # its jobs follow from the plan alone (no earlier outputs): none planned, none run
    estimate: Callable[[SweepContext, list[dict[str, Any]]], list[dict[str, Any]]] | None = (
        None  # dry-run rows
    )
    # (given the rows of earlier stages) for a stage whose jobs need earlier outputs
    after: Callable[[SweepContext], None] | None = None  # orchestrator bookkeeping once its jobs ran

    def run_ref(self) -> tuple[str, str]:
        if callable(self.run):
            return self.run.__module__, self.run.__qualname__
        module, _, name = self.run.partition(":")
        return module, name


_REGISTRY: dict[str, Stage] = {}


def register(stage: Stage) -> Stage:
    if stage.name in _REGISTRY and _REGISTRY[stage.name] is not stage:
        raise ValueError(f"stage {stage.name!r} is declared twice")
    if not stage.records <= RECORD_KINDS:
        raise ValueError(
            f"stage {stage.name!r}: records {sorted(stage.records)}; allowed: {sorted(RECORD_KINDS)}"
        )
    _REGISTRY[stage.name] = stage
    _ordered.cache_clear()
    code_fingerprints.cache_clear()
    return stage


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)
    _ordered.cache_clear()
    code_fingerprints.cache_clear()


def stages() -> tuple[Stage, ...]:
    """Every registered stage, each after the stages it reads (declaration order otherwise). The built-in
    stages are declared when the orchestrator package is imported (orchestrator/__init__.py)."""
    return _ordered()


def get_stage(name: str) -> Stage:
    for s in stages():
        if s.name == name:
            return s
    raise ValueError(f"unknown stage {name!r}; allowed: {', '.join(s.name for s in stages())}")


@cache
def _ordered() -> tuple[Stage, ...]:
    todo = list(_REGISTRY.values())
    names = {s.name for s in todo}
    for s in todo:
        missing = [u for u in s.upstream if u not in names]
        if missing:
            raise ValueError(
                f"stage {s.name!r}: upstream {missing} not registered; known: {', '.join(sorted(names))}"
            )
    done: list[Stage] = []
    while todo:
        ready = next((s for s in todo if all(u in {d.name for d in done} for u in s.upstream)), None)
        if ready is None:
            raise ValueError(f"stages {[s.name for s in todo]} read each other in a cycle")
        done.append(ready)
        todo.remove(ready)
    return tuple(done)


# ---- code versions and content keys -------------------------------------------------------------------
@cache
def library_versions() -> dict[str, str]:
    out = {}
    for lib in LIBS:
        try:
            out[lib] = version(lib.replace("_", "-"))
        except PackageNotFoundError:
            out[lib] = "none"
    return out


@cache
def code_fingerprints():
    from orchestrator.axes import method_registries
    from orchestrator.codever import Fingerprints

    roots = {s.run_ref()[0].split(".")[0] for s in _REGISTRY.values()}
    return Fingerprints(stop=method_registries(), extra_roots=roots)


def code_components(stage: str, params: dict[str, Any]) -> dict[str, str]:
    """{component: hash} of the code that computes a job: its stage's run function (with everything it
    calls) and, for each axis value its parameters name (at any depth: a student recipe names its
    output), that method's registry entry."""
    from orchestrator.axes import AXES

    fp = code_fingerprints()
    st = get_stage(stage)
    out = {f"stage:{stage}": fp.digest([st.run_ref()])}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                axis = AXES.get(name)
                if axis is not None and axis.registry and isinstance(value, str):
                    out[f"{name}:{value}"] = fp.digest([(*axis.registry, value)])
                else:
                    walk(value)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(params)
    return {name: ALIASES.get(name, {}).get(digest, digest) for name, digest in out.items()}


def _aliases() -> dict[str, dict[str, str]]:
    path = Path(__file__).with_name("code_aliases.json")
    return json.loads(path.read_text())["aliases"] if path.is_file() else {}


# component → {digest as computed today: the digest an earlier release stored for the very same code}
# (scripts/code_aliases.py writes and checks it): results computed before code versions were identified by
# name rather than module are reused, never results of other code
ALIASES: dict[str, dict[str, str]] = _aliases()


def is_stale(stage: str, params: dict[str, Any], code_json: str | None) -> bool:
    """Whether a stored job was computed by code other than the current code (or by an unknown stage)."""
    try:
        current = code_components(stage, params)
    except (ValueError, KeyError, ModuleNotFoundError):
        return True
    return code_json is None or json.loads(code_json) != current


def code_version(components: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(components, sort_keys=True).encode()).hexdigest()[:16]


def content_key(stage: str, params: dict[str, Any], deps: dict[str, str], code: dict[str, str]) -> str:
    blob = json.dumps(
        {"stage": stage, "params": params, "deps": deps, "code": code, "libraries": library_versions()},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class JobSpec:
    """One content-keyed job. `key_deps` are the upstream keys its key hashes (default: all of `deps`;
    a student's evaluation hashes its plan's content instead of the conversion job that wrote it)."""

    stage: str
    params: dict[str, Any]
    deps: dict[str, str] = field(default_factory=dict)  # role -> upstream job key
    resident: str | None = None  # the model this job wants kept in memory
    cpus: float = 1
    gpus: float = 0
    custom: dict[str, float] = field(default_factory=dict)  # Ray custom resources (not part of the key)
    key_deps: dict[str, str] | None = None
    code: dict[str, str] = field(default_factory=dict)
    key: str = ""

    def __post_init__(self) -> None:
        self.code = self.code or code_components(self.stage, self.params)
        deps = self.deps if self.key_deps is None else self.key_deps
        self.key = self.key or content_key(self.stage, self.params, deps, self.code)

    def record(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "stage": self.stage,
            "params": self.params,
            "code_version": code_version(self.code),
            "code_json": json.dumps(self.code, sort_keys=True),
        }


def unique(jobs) -> list[JobSpec]:
    seen: dict[str, JobSpec] = {}
    for j in jobs:
        if j is not None:
            seen.setdefault(j.key, j)
    return list(seen.values())


# ---- what a stage's `jobs` function sees ----------------------------------------------------------------------
@dataclass
class SweepContext:
    """The sweep, the teacher's shape (read from its config, or for a dry run what the sweep file states, the
    fields it cannot tell None), the configurations, and what earlier stages planned and produced.

    `jobs[stage]` maps a configuration key (or a label, for a stage without configurations) to its job;
    `outputs[stage]` maps a job key to the outputs of that job if it succeeded. The launcher supplies
    `select` (the sweep's selection rule over the stored results) and `add_configs` (new
    configurations, such as distillation variants); a dry run supplies neither."""

    spec: Any
    shape: TeacherShape
    configs: list[dict[str, Any]]
    jobs: dict[str, dict[str, JobSpec]] = field(default_factory=dict)
    outputs: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    select: Callable[[], list[str]] | None = None
    add_configs: Callable[[list[dict[str, Any]]], None] | None = None
    set_fields: Callable[[dict[str, dict[str, Any]]], None] | None = None  # config_key → column values
    # a stage that plans in rounds (distill.search's rungs): run a round of its jobs now ({config key: job}
    # → {job key: outputs} of those that succeeded), and read jobs' metric rows (job keys, a metric name →
    # rows with key, who, task, step, value); a dry run supplies neither
    run_now: Callable[[str, dict[str, JobSpec]], dict[str, dict[str, Any]]] | None = None
    job_metrics: Callable[[list[str], str], list[dict[str, Any]]] | None = None

    def config(self, key: str) -> dict[str, Any]:
        return next(c for c in self.configs if c["config_key"] == key)

    def succeeded(self, stage: str, config_key: str) -> dict[str, Any] | None:
        """The outputs of `stage`'s job for a configuration, if it ran and succeeded."""
        job = self.jobs.get(stage, {}).get(config_key)
        return None if job is None else self.outputs.get(stage, {}).get(job.key)

    def resources(self, stage: str) -> dict[str, Any]:
        res = self.spec.resources(stage)
        return {"cpus": res.cpus, "gpus": res.gpus, "custom": dict(res.custom)}

    def job(
        self,
        stage: str,
        params: dict[str, Any],
        deps: dict[str, str] | None = None,
        *,
        resident: str | None = None,
        key_deps: dict[str, str] | None = None,
    ) -> JobSpec:
        return JobSpec(
            stage, params, dict(deps or {}), resident=resident, key_deps=key_deps, **self.resources(stage)
        )
