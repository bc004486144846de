"""teacher / dense_teacher: the models every other stage starts from.

A Hugging Face teacher (`source: hf`) is not a job: it is loaded by id or path where it is used. The
embedded tiny teachers are trained once (a job, cached by content key): the MoE teacher, and the dense
teacher with the same total parameters that the dense-to-dense baseline prunes.
"""

from __future__ import annotations

from typing import Any

from orchestrator.schema import Resources, Teacher
from orchestrator.stage import JobSpec, Stage, SweepContext


def teacher_job(ctx: SweepContext, which: str = "teacher") -> JobSpec | None:
    t = ctx.spec.teacher if which == "teacher" else ctx.spec.dense_teacher
    if t is None or t.source != "tiny":
        return None
    return ctx.job(which, {"tiny": t.tiny, "kind": which})


def teacher_ref(ctx: SweepContext, which: str = "teacher") -> tuple[dict[str, Any], dict[str, str], str]:
    """(params describing the teacher, deps, resident-model key) for jobs that load it."""
    t = ctx.spec.teacher if which == "teacher" else ctx.spec.dense_teacher
    if t.source == "hf":
        params = {"source": "hf", "model": t.model, "revision": t.revision, "dtype": t.dtype}
        return params, {}, f"hf:{t.model}@{t.revision}:{t.dtype}"
    job = teacher_job(ctx, which)
    return {"source": "tiny", "dtype": t.dtype}, {which: job.key}, f"job:{job.key}"


def teacher_label(spec) -> str:
    t = spec.teacher
    return t.label or (t.model.rstrip("/").split("/")[-1] if t.model else "tiny-moe")


def _jobs(which: str):
    def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
        job = teacher_job(ctx, which)
        if job is None:
            return {}
        d2d = [c["config_key"] for c in ctx.configs if (c.get("baseline") or "").startswith("d2d:")]
        users = (
            d2d
            if which == "dense_teacher"
            else [c["config_key"] for c in ctx.configs if c["config_key"] not in d2d]
        )
        return {ck: job for ck in users} or {which: job}

    return jobs


STAGE = Stage(
    name="teacher",
    run="workers.run.teacher:stage_teacher",
    jobs=_jobs("teacher"),
    section="teacher",
    params=Teacher,
    section_default="required",
    resources=Resources(cpus=1),
    shared=True,
    records=frozenset({"outputs", "metrics", "artifacts"}),
    summary="train the embedded tiny MoE teacher (an HF teacher is loaded where it is used)",
)

DENSE = Stage(
    name="dense_teacher",
    run="workers.run.teacher:stage_teacher",
    jobs=_jobs("dense_teacher"),
    section="dense_teacher",
    params=Teacher,
    shared=True,
    records=frozenset({"outputs", "metrics", "artifacts"}),
    summary="train the dense teacher of the dense-to-dense baseline",
)
