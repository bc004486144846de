"""evaluate: lm-eval tasks (and the post-distillation perplexity) of every distilled student and of
the teacher."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import field_validator

from orchestrator.schema import PosInt, Strict
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


class Evaluate(Strict):
    suite: str | list[dict[str, Any]] = "tiny"
    backend: Literal["hf", "vllm"] = "hf"
    batch_size: PosInt = 16
    limit: PosInt | None = None  # samples per task (for quick looks); None = all
    ppl: bool = True  # also the post-distill perplexity
    save: bool = False  # also write each student built from its plan (a smaller MoE…) as a checkpoint

    @field_validator("suite")
    @classmethod
    def _suite(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        from workers.suites import validate_suite

        validate_suite(v)
        return v


def evaluate_job(ctx: SweepContext, upstream: JobSpec) -> JobSpec:
    """Evaluate a distilled student (upstream = its distill job), a smaller MoE with its routers retrained
    (upstream = its router_kd job), or a student as converted, and the teacher (upstream = its ppl job)."""
    tparams, tdeps, resident = teacher_ref(ctx)
    params = {"evaluate": ctx.spec.evaluate.model_dump(), "ppl": ctx.spec.ppl.model_dump(), "teacher": tparams}
    deps = dict(tdeps)
    if upstream.stage == "distill":
        deps["distill"] = upstream.key
        params["student"] = {"type": "distilled"}
        return ctx.job("evaluate", params, deps, resident=resident)
    if upstream.stage == "router_kd":
        deps["router_kd"] = upstream.key
        params["student"] = {"type": "router_kd", "base": upstream.params["student"]}
    else:
        params["student"] = upstream.params["student"]
    if "convert" in upstream.deps:  # a student built from its plan: keyed by the plan's content
        deps["convert"] = upstream.deps["convert"]
    return ctx.job("evaluate", params, deps, resident=resident,
                   key_deps={k: v for k, v in deps.items() if k != "convert"})


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    if ctx.spec.evaluate is None:
        return {}
    done = ctx.outputs.get("distill", {})
    out = {ck: evaluate_job(ctx, j) for ck, j in ctx.jobs.get("distill", {}).items() if j.key in done}
    teacher = ctx.jobs.get("ppl_pre", {}).get("teacher")
    if teacher is not None:
        out["teacher"] = evaluate_job(ctx, teacher)
    for c in ctx.configs:  # every smaller MoE is evaluated: as converted, routers retrained, or distilled (above)
        ck, recovery = c["config_key"], c.get("recovery")
        if recovery == "none" and ctx.succeeded("ppl_pre", ck) is not None:
            out[ck] = evaluate_job(ctx, ctx.jobs["ppl_pre"][ck])
        elif recovery == "router_kd" and ctx.succeeded("router_kd", ck) is not None:
            out[ck] = evaluate_job(ctx, ctx.jobs["router_kd"][ck])
    return out


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ev = ctx.spec.evaluate
    dist = next((r for r in rows if r["stage"] == "distill"), {"named": 0})
    if ev is None:
        return []
    teacher = int(any(c["kind"] == "teacher" for c in ctx.configs))
    moe = sum(1 for c in ctx.configs if c.get("recovery") in ("none", "router_kd"))  # full_kd: in distill's
    n = dist["named"] + teacher + moe
    suite = ev.suite if isinstance(ev.suite, str) else "custom"
    return [{"stage": "evaluate", "named": n, "distinct": n,
             "note": f"suite {suite}" + (" + teacher" if teacher else "") + (f" + {moe} smaller MoEs" if moe else "")}]


STAGE = Stage(
    name="evaluate", run="workers.stages:stage_evaluate", jobs=jobs, section="evaluate", params=Evaluate,
    upstream=("distill", "router_kd"), records=frozenset({"outputs", "metrics", "artifacts"}), estimate=estimate,
    summary="lm-eval suite and post-distillation perplexity")
