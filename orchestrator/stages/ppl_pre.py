"""ppl_pre: the perplexity of every student before distillation (and of the teacher and baselines).

A student is keyed by what makes it — its conversion plan's content, not the job that wrote the plan —
so configurations whose plans are equal (K = k makes grouping irrelevant; two scorings that keep the
same experts) share one evaluation and are marked `duplicate_of` the first of them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from db.axes import CONVERTED_KINDS
from orchestrator.schema import Data, PosInt, Strict
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.convert import subgrids
from orchestrator.stages.teacher import teacher_ref


class Perplexity(Strict):
    data: Data = Field(default_factory=lambda: Data(split="test"))
    seq_len: PosInt = 128
    max_windows: PosInt | None = None
    batch_size: PosInt = 16
    add_bos: bool = False
    windows: Literal["disjoint", "rolling"] = "disjoint"  # rolling = lm-eval's protocol (needs add_bos)
    # decoder layers torch.compile'd, the compiled code shared by every student of one architecture in a
    # worker (workers/evaluation/ppl.py): auto = on CUDA only
    compile: bool | Literal["auto"] = "auto"

    @field_validator("compile", mode="before")
    @classmethod
    def _compile(cls, v: Any) -> Any:
        if v == "auto" or isinstance(v, bool):
            return v
        raise ValueError(f"must be 'auto', true or false, got {v!r}")


def student_recipe(cfg: dict[str, Any], plan_out: dict[str, Any] | None) -> dict[str, Any]:
    """How a configuration's student is made, as content (what its evaluation and distillation keys hash)."""
    if cfg["kind"] == "teacher":
        return {"type": "teacher"}
    if cfg["kind"] == "baseline":
        b = cfg["baseline"]
        if b.startswith("d2d:"):
            return {"type": "d2d", "candidate": b.split(":", 1)[1]}
        return {"type": b, "seed": 0}
    assert plan_out is not None
    # the output names the code that builds the student from its plan (a code component of every job
    # that builds it: its evaluations, distillation, Router KD)
    return {"type": "plan", "plan_key": plan_out["plan_key"], "output": cfg.get("output") or "dense"}


def ppl_job(
    ctx: SweepContext, cfg: dict[str, Any], stage: str = "ppl_pre", convert_stage: str = "convert"
) -> JobSpec:
    """`convert_stage`: the stage whose job wrote the configuration's plan (seed_convert for a seed repeat)."""
    convert = ctx.jobs.get(convert_stage, {}).get(cfg["config_key"])
    recipe = student_recipe(cfg, ctx.succeeded(convert_stage, cfg["config_key"]))
    which = "dense_teacher" if recipe["type"] == "d2d" else "teacher"
    tparams, tdeps, resident = teacher_ref(ctx, which)
    params = {"teacher": tparams, "student": recipe, "ppl": ctx.spec.ppl.model_dump()}
    if recipe["type"] == "d2d":  # activation importance is measured on the calibration data
        params["calibration"] = ctx.spec.calibration.model_dump()
        params["moe_teacher"] = teacher_ref(ctx)[0]  # its K = k student's size is the pruning target
    deps = {**tdeps, **({"convert": convert.key} if convert is not None else {})}
    return ctx.job(stage, params, deps, resident=resident, key_deps=tdeps)


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    out = {}
    for cfg in ctx.configs:
        if cfg.get("variant_of") is not None and cfg["config_key"] not in ctx.jobs.get("convert", {}):
            continue  # a distillation variant: its base's student (a DCDM mixture has a conversion of its own)
        if cfg["kind"] in CONVERTED_KINDS and ctx.succeeded("convert", cfg["config_key"]) is None:
            continue  # its conversion failed: nothing downstream of it runs
        out[cfg["config_key"]] = ppl_job(ctx, cfg)
    return out


def after(ctx: SweepContext) -> None:
    """Each configuration records the content key of its conversion plan."""
    ctx.set_fields(
        {
            ck: {"plan_key": ctx.succeeded("convert", ck)["plan_key"]}
            for ck in ctx.jobs.get("ppl_pre", {})
            if ctx.succeeded("convert", ck)
        }
    )


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    plans = {j.key for j in ctx.jobs.get("convert", {}).values()}
    others = [c for c in ctx.configs if c["kind"] not in CONVERTED_KINDS]
    k = ctx.shape.top_k
    collapse = 0
    for g in subgrids(ctx.spec):
        if g.grouping:  # K = k: every grouping of a dense sub-grid gives one student
            at_k = sum(1 for K in g.K if K == k) * len(g.scoring) * len(g.dp_scaling) * len(g.grouping)
            collapse += at_k - at_k // len(g.grouping)
    return [
        {
            "stage": "ppl_pre",
            "named": len(ctx.configs),
            "distinct": len(plans) + len(others) - collapse,
            "note": "at most"
            + (f"; {collapse} collapse at K = k (grouping irrelevant)" if collapse else "")
            + ", fewer where plans coincide",
        }
    ]


STAGE = Stage(
    name="ppl_pre",
    run="workers.run.ppl_pre:stage_ppl_pre",
    jobs=jobs,
    section="ppl",
    params=Perplexity,
    section_default="default",
    upstream=("convert", "dense_teacher"),
    identity=True,
    after=after,
    records=frozenset({"outputs", "metrics", "item_scores"}),
    estimate=estimate,
    summary="perplexity of each distinct student before distillation",
)
