"""evaluate: lm-eval tasks (and the post-distillation perplexity) of every distilled student and of
the teacher."""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ValidationInfo, field_validator

from db.axes import recovered_by
from orchestrator.schema import PosInt, Strict
from orchestrator.search import stopped_trials
from orchestrator.stage import JobSpec, Stage, SweepContext, unique
from orchestrator.stages.teacher import teacher_ref


class Evaluate(Strict):
    suite: str | list[dict[str, Any]] = "tiny"
    backend: Literal["hf", "vllm"] = "hf"
    batch_size: PosInt = 16
    limit: PosInt | None = None  # samples per task (for quick looks); None = all
    ppl: bool = True  # also the post-distill perplexity
    save: bool = False  # also write each student built from its plan (a smaller MoE…) as a checkpoint
    # declared generative tasks (workers/evaluation/suites.py GENERATIVE): names or {task, num_fewshot, limit, data_dir |
    # data_files, split}; one whose needs are unmet here is stored as not run, with its reason
    generative: list[str | dict[str, Any]] = []
    allow_cpu: bool = False  # run generative tasks that declare requires.gpu on the CPU (small models)
    allow_code_eval: bool = False  # let HumanEval/MBPP run model-written code (HF_ALLOW_CODE_EVAL=1)
    # repeated evaluations of each model, e.g. [{seed: 0}, {seed: 1}]: fields seed, num_fewshot, limit;
    # run i is stored in the metrics' `step` = i (without runs: one run, step -1)
    runs: list[dict[str, Any]] | None = None

    @field_validator("suite")
    @classmethod
    def _suite(cls, v: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        from workers.evaluation.suites import validate_suite

        validate_suite(v)
        return v

    @field_validator("generative")
    @classmethod
    def _generative(cls, v: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        from workers.evaluation.suites import validate_generative

        validate_generative(v)
        return v

    @field_validator("runs")
    @classmethod
    def _runs(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        from workers.evaluation.evaluate import validate_runs

        validate_runs(v)
        return v


def _needs_the_tiny_corpus(v: Evaluate) -> list[str]:
    """What of the section reads the tiny teacher's held-out corpus: the suite "tiny", the task "tiny_gen"."""
    needs = ["suite: tiny"] if v.suite == "tiny" else []
    for g in v.generative:
        if (g if isinstance(g, str) else g.get("task")) == "tiny_gen":
            needs.append("generative: tiny_gen")
    return needs


def _with_teacher(v: Evaluate, info: ValidationInfo) -> Evaluate:
    """The section read against the teacher sections (validated before it): the tiny suite and task are
    built from the tiny teacher's corpus, so they need a `tiny` teacher or dense teacher."""
    needs = _needs_the_tiny_corpus(v)
    teachers = [info.data.get(name) for name in ("teacher", "dense_teacher")]
    if needs and not any(t is not None and t.source == "tiny" for t in teachers):
        raise ValueError(
            f"{' and '.join(needs)} is built from the tiny teacher's corpus, and this sweep's teacher is not "
            f"the tiny one; name another suite (allowed: 'paper' or a list of tasks)"
        )
    return v


EvaluateSection = Annotated[Evaluate, AfterValidator(_with_teacher)]


def seeded_runs(runs: list[dict[str, Any]] | None, offset: int) -> list[dict[str, Any]]:
    """A seed repeat's runs: each run's lm-eval seed (0 when unset) shifted by the repeat's offset."""
    return [{**r, "seed": r.get("seed", 0) + offset} for r in (runs or [{}])]


def evaluate_job(ctx: SweepContext, upstream: JobSpec, seed_offset: int = 0) -> JobSpec:
    """Evaluate a distilled student (upstream = its distill job), a smaller MoE with its routers retrained
    (upstream = its router_kd job), or a student as converted, and the teacher (upstream = its ppl job).
    A seed repeat (`seed_offset` > 0) shifts lm-eval's seeds; the items it scores stay the same."""
    tparams, tdeps, resident = teacher_ref(ctx)
    params = {
        "evaluate": ctx.spec.evaluate.model_dump(),
        "ppl": ctx.spec.ppl.model_dump(),
        "teacher": tparams,
    }
    if seed_offset:
        params["evaluate"]["runs"] = seeded_runs(params["evaluate"]["runs"], seed_offset)
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
    return ctx.job(
        "evaluate",
        params,
        deps,
        resident=resident,
        key_deps={k: v for k, v in deps.items() if k != "convert"},
    )


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    if ctx.spec.evaluate is None:
        return {}
    done = ctx.outputs.get("distill", {})
    known = {c["config_key"] for c in ctx.configs}
    distilled = ctx.jobs.get("distill", {})
    search = ctx.spec.distill.search if ctx.spec.distill is not None else None
    skip = set()
    if search is not None and search.evaluate == "finalists":  # not the trials stopped at an early rung
        skip = stopped_trials(search, ctx.spec.distill.settings, distilled)
    out = {
        ck: evaluate_job(ctx, j, ctx.config(ck).get("seed_offset", 0) if ck in known else 0)
        for ck, j in distilled.items()
        if j.key in done and ck not in skip
    }
    teacher = ctx.jobs.get("ppl_pre", {}).get("teacher")
    if teacher is not None:
        out["teacher"] = evaluate_job(ctx, teacher)
    for c in ctx.configs:  # every smaller MoE: the model of the stage its recovery names (distill's: above)
        ck, stage = c["config_key"], recovered_by(c)
        if stage not in (None, "distill") and ctx.succeeded(stage, ck) is not None:
            out[ck] = evaluate_job(ctx, ctx.jobs[stage][ck])
    return out


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    ev = ctx.spec.evaluate
    dist = next((r for r in rows if r["stage"] == "distill"), {"named": 0})
    if ev is None:
        return []
    teacher = int(any(c["kind"] == "teacher" for c in ctx.configs))
    moe = sum(1 for c in ctx.configs if recovered_by(c) not in (None, "distill"))  # distill's: counted there
    n = dist.get("evaluated", dist["named"]) + teacher + moe
    suite = ev.suite if isinstance(ev.suite, str) else "custom"
    gen = [e if isinstance(e, str) else e["task"] for e in ev.generative]
    note = (
        f"suite {suite}"
        + (f" + {', '.join(gen)}" if gen else "")
        + (f", {len(ev.runs)} runs each" if ev.runs else "")
        + (" + teacher" if teacher else "")
        + (f" + {moe} smaller MoEs" if moe else "")
    )
    return [{"stage": "evaluate", "named": n, "distinct": n, "note": note}]


def not_run_lines(ctx: SweepContext) -> list[str]:
    """One line per generative task that some evaluation did not run, with its reason and how many models."""
    seen: dict[tuple[str, str], int] = {}
    for job in unique(ctx.jobs.get("evaluate", {}).values()):
        for task, reason in (ctx.outputs.get("evaluate", {}).get(job.key) or {}).get("not_run", {}).items():
            seen[(task, reason)] = seen.get((task, reason), 0) + 1
    return [
        f"evaluate: {task} not run ({n} model{'s' if n > 1 else ''}): {reason}"
        for (task, reason), n in sorted(seen.items())
    ]


def after(ctx: SweepContext) -> None:
    """Say on the console which declared generative tasks were not run, and why (their rows hold no number)."""
    for line in not_run_lines(ctx):
        print(line, file=sys.stderr)


STAGE = Stage(
    name="evaluate",
    run="workers.run.evaluate:stage_evaluate",
    jobs=jobs,
    section="evaluate",
    params=EvaluateSection,
    upstream=("distill", "router_kd"),
    records=frozenset({"outputs", "metrics", "artifacts", "item_scores"}),
    estimate=estimate,
    summary="lm-eval suite, generative tasks and post-distillation perplexity",
    after=after,
)
