"""Sweep spec → configurations and content-keyed stage jobs (DESIGN.md §2, issue 4).

Stages: teacher → calibrate → convert → ppl_pre → (select) → distill → evaluate. A job's key is a
hash of (stage, its parameters, its upstream keys, code and library versions), so a calibration
is shared by every configuration and every sweep that names it, and configurations whose
conversion is provably identical (K = k makes grouping irrelevant; two scorings that keep the
same experts) share one student and one evaluation.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from orchestrator.spec import SpecError, SweepSpec

LIBS = ("moesweep", "torch", "transformers", "lm_eval")


@cache
def versions() -> dict[str, str]:
    out = {}
    for lib in LIBS:
        try:
            out[lib] = version(lib.replace("_", "-"))
        except PackageNotFoundError:
            out[lib] = "none"
    return out


def content_key(stage: str, params: dict[str, Any], deps: dict[str, str]) -> str:
    blob = json.dumps({"stage": stage, "params": params, "deps": deps, "versions": versions()},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass
class JobSpec:
    stage: str
    params: dict[str, Any]
    deps: dict[str, str] = field(default_factory=dict)  # role -> upstream job key
    resident: str | None = None  # the model this job wants kept in memory
    cpus: float = 1
    gpus: float = 0
    key: str = ""

    def __post_init__(self) -> None:
        self.key = self.key or content_key(self.stage, self.params, self.deps)

    def record(self) -> dict[str, Any]:
        return {"key": self.key, "stage": self.stage, "params": self.params,
                "code_version": versions()["moesweep"]}


def teacher_shape(spec: SweepSpec) -> tuple[int | None, int | None]:
    """(E, k) of the teacher as far as the sweep file tells (no download)."""
    if spec.teacher.source == "tiny":
        from workers.tiny.teacher import TinyTeacherSpec

        t = TinyTeacherSpec(**spec.teacher.tiny)
        return t.experts, t.top_k
    return spec.teacher.num_experts, spec.teacher.top_k


def teacher_label(spec: SweepSpec) -> str:
    t = spec.teacher
    return t.label or (t.model.rstrip("/").split("/")[-1] if t.model else "tiny-moe")


@dataclass
class Plan:
    """The static part of a sweep's graph; later stages are planned from earlier outputs."""

    spec: SweepSpec
    configs: list[dict[str, Any]]
    teacher: JobSpec | None
    dense_teacher: JobSpec | None
    calibrate: JobSpec
    convert: dict[str, JobSpec]  # config_key -> job (shared between configs)

    @property
    def static_jobs(self) -> list[JobSpec]:
        jobs = [j for j in (self.teacher, self.dense_teacher, self.calibrate) if j is not None]
        return jobs + unique(self.convert.values())


def unique(jobs) -> list[JobSpec]:
    seen: dict[str, JobSpec] = {}
    for j in jobs:
        seen.setdefault(j.key, j)
    return list(seen.values())


def res(spec: SweepSpec, stage: str) -> dict[str, float]:
    r = spec.resources(stage)
    return {"cpus": r.cpus, "gpus": r.gpus}


def teacher_ref(spec: SweepSpec, which: str = "teacher") -> tuple[dict[str, Any], dict[str, str], str]:
    """(params describing the teacher, deps, resident key) for jobs that load it."""
    t = spec.teacher if which == "teacher" else spec.dense_teacher
    assert t is not None
    if t.source == "hf":
        params = {"source": "hf", "model": t.model, "revision": t.revision, "dtype": t.dtype}
        return params, {}, f"hf:{t.model}@{t.revision}:{t.dtype}"
    params = {"source": "tiny", "dtype": t.dtype}
    key = content_key(which, {"tiny": t.tiny, "kind": which}, {})
    return params, {which: key}, f"job:{key}"


def build_plan(spec: SweepSpec) -> Plan:
    E, k = teacher_shape(spec)
    for K in spec.grid.K:
        if k is not None and K < k:
            raise SpecError(f"grid.K: {K} is below the router's top-k ({k}); allowed: {k} ≤ K ≤ {E}")
        if E is not None and K > E:
            raise SpecError(f"grid.K: {K} exceeds the number of experts ({E}); allowed: {k} ≤ K ≤ {E}")

    teacher = None
    if spec.teacher.source == "tiny":
        teacher = JobSpec("teacher", {"tiny": spec.teacher.tiny, "kind": "teacher"}, **res(spec, "teacher"))
    dense = None
    if spec.dense_teacher is not None and spec.dense_teacher.source == "tiny":
        dense = JobSpec("dense_teacher", {"tiny": spec.dense_teacher.tiny, "kind": "dense_teacher"},
                        **res(spec, "dense_teacher"))
    tparams, tdeps, resident = teacher_ref(spec)
    calib = JobSpec("calibrate", {"teacher": tparams, **spec.calibration.model_dump()}, dict(tdeps),
                    resident=resident, **res(spec, "calibrate"))

    model = teacher_label(spec)
    configs: list[dict[str, Any]] = []
    convert: dict[str, JobSpec] = {}
    for scoring in spec.grid.scoring:
        for grouping in spec.grid.grouping:
            for scaling in spec.grid.dp_scaling:
                for K in spec.grid.K:
                    ck = f"{scoring}|{grouping}|{scaling}|K={K}"
                    configs.append({"config_key": ck, "model": model, "kind": "moe2dense",
                                    "teacher_variant": spec.teacher.variant, "scoring": scoring,
                                    "grouping": grouping, "dp_scaling": scaling, "K": K, "top_k": k})
                    # K = k: one expert per group, so the grouping cannot change the student (§4.2)
                    g = "*" if K == k else grouping
                    convert[ck] = JobSpec("convert", {"teacher": tparams, "scoring": scoring, "grouping": g,
                                                      "dp_scaling": scaling, "K": K},
                                          {**tdeps, "calibrate": calib.key}, resident=resident,
                                          **res(spec, "convert"))
    for b in spec.baselines:
        if b == "d2d":
            continue  # candidates are configurations of their own, added below
        configs.append({"config_key": "teacher" if b == "teacher" else f"baseline:{b}", "model": model,
                        "kind": "teacher" if b == "teacher" else "baseline",
                        "baseline": None if b == "teacher" else b, "teacher_variant": spec.teacher.variant,
                        "top_k": k})
    if "d2d" in spec.baselines:
        from workers.baselines import d2d_candidate_names

        for name in d2d_candidate_names():
            configs.append({"config_key": f"baseline:d2d:{name}", "model": model, "kind": "baseline",
                            "baseline": f"d2d:{name}"})
    return Plan(spec, configs, teacher, dense, calib, convert)


# ---- later stages -----------------------------------------------------------------------------
def student_recipe(cfg: dict[str, Any], plan_out: dict[str, Any] | None) -> dict[str, Any]:
    """How a configuration's student is made, as content (what its ppl/distill keys hash)."""
    if cfg["kind"] == "teacher":
        return {"type": "teacher"}
    if cfg["kind"] == "baseline":
        b = cfg["baseline"]
        if b.startswith("d2d:"):
            return {"type": "d2d", "candidate": b.split(":", 1)[1]}
        return {"type": b, "seed": 0}
    assert plan_out is not None
    return {"type": "plan", "plan_key": plan_out["plan_key"]}


def ppl_job(spec: SweepSpec, cfg: dict[str, Any], convert_job: JobSpec | None, plan_out: dict | None,
            stage: str = "ppl_pre") -> JobSpec:
    recipe = student_recipe(cfg, plan_out)
    which = "dense_teacher" if recipe["type"] == "d2d" else "teacher"
    tparams, tdeps, resident = teacher_ref(spec, which)
    deps = dict(tdeps)
    if convert_job is not None:
        deps["convert"] = convert_job.key
    params = {"teacher": tparams, "student": recipe, "ppl": spec.ppl.model_dump()}
    if recipe["type"] == "d2d":  # activation importance is measured on the calibration data
        params["calibration"] = spec.calibration.model_dump()
        params["moe_teacher"] = teacher_ref(spec)[0]  # its K = k student's size is the pruning target
    # the key hashes the plan's content, not the convert job: equal plans share one evaluation
    key = content_key(stage, params, {k: v for k, v in deps.items() if k != "convert"})
    return JobSpec(stage, params, deps, resident=resident, key=key, **res(spec, stage))


def select_best(rows: list[dict[str, Any]], per: list[str], over: list[str]) -> list[dict[str, Any]]:
    """For each group of `per` axes, the row with the lowest finite ppl_pre over `over` (§4.1)."""
    from db.select_rule import select_best_rows

    return select_best_rows(rows, per, over, "ppl_pre")


def distill_job(spec: SweepSpec, ppl: JobSpec, overrides: dict[str, Any]) -> JobSpec:
    assert spec.distill is not None
    tparams, tdeps, resident = teacher_ref(spec)
    student = ppl.params["student"]
    deps = {k: v for k, v in ppl.deps.items()}
    if student["type"] == "d2d":  # distilled from its own dense teacher (Appendix M)
        tparams, tdeps, resident = teacher_ref(spec, "dense_teacher")
        deps.update(tdeps)
    else:
        deps.update(tdeps)
    params = {"teacher": tparams, "student": student, "teacher_of_student": ppl.params["teacher"],
              "settings": {**spec.distill.settings, **overrides}, "data": spec.distill.data.model_dump(),
              "val_data": spec.distill.val_data.model_dump(), "processes": spec.distill.processes}
    key = content_key("distill", params, {k: v for k, v in deps.items() if k != "convert"})
    return JobSpec("distill", params, deps, resident=resident, key=key, **res(spec, "distill"))


def distill_tokens(settings: dict[str, Any]) -> str:
    """A distillation's token budget as shown in tables (e.g. "98k", "0.3B"). Variant runs (Tables 4/5)
    are marked by the config columns distill_loss / teacher_top_k, set from their overrides."""
    from workers.distill import DistillSpec

    return human_tokens(DistillSpec(**settings).tokens)


def human_tokens(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def evaluate_job(spec: SweepSpec, upstream: JobSpec) -> JobSpec:
    """Evaluate a distilled student (upstream = distill job) or the teacher (upstream = its ppl job)."""
    assert spec.evaluate is not None
    tparams, tdeps, resident = teacher_ref(spec)
    params = {"evaluate": spec.evaluate.model_dump(), "ppl": spec.ppl.model_dump(), "teacher": tparams}
    deps = dict(tdeps)
    if upstream.stage == "distill":
        deps["distill"] = upstream.key
        params["student"] = {"type": "distilled"}
    else:
        params["student"] = upstream.params["student"]
    return JobSpec("evaluate", params, deps, resident=resident, **res(spec, "evaluate"))
