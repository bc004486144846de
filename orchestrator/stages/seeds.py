"""seed_convert / seed_ppl: seed repeats of the selected students (`seeds: [1, 2, 3]`).

The first listed seed is the sweep as written: its configurations, jobs and keys are those of a sweep
without `seeds`, so nothing already computed runs again. Each further seed s repeats the chain of every
dense student the selection rule picked with every seed of the chain shifted by s − seeds[0]: its own
calibration (`calibration.seed` + offset: one calibrate job per seed, shared by all students, planned in
the calibrate stage), the same conversion on it (seed_convert), its pre-distillation perplexity
(seed_ppl), the distillation (`distill.settings.seed` + offset: data order and validation windows) and
the evaluation (lm-eval's seeds = each run's seed + offset: few-shot and generation sampling; the items
stay the same, so the paired item-level intervals stay paired). Each repeat is a configuration of its
own, `<config_key>|seed=<s>`, with `variant` `seed=<s>` and `variant_of` the configuration it repeats;
as a variant it never competes in the selection rule. Only the picks are repeated: cheap beside the grid.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, StrictInt

from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.ppl_pre import ppl_job


def _increasing(v: list[int]) -> list[int]:
    if not v or any(x < 0 for x in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
        raise ValueError(
            f"must be a non-empty list of increasing integers >= 0 (the first is the sweep as "
            f"written), got {v}"
        )
    return v


Seeds = Annotated[list[StrictInt], AfterValidator(_increasing)]


def offsets(spec) -> dict[int, int]:
    """{seed: offset from the first listed seed} of the repeats (the first seed is the sweep itself)."""
    seeds = getattr(spec, "seeds", None) or []
    return {s: s - seeds[0] for s in seeds[1:]}


def label(seed: int) -> str:
    """The variant label of a repeat, and the tail of its configuration key."""
    return f"seed={seed}"


def seeded_calibrations(
    ctx: SweepContext, params: dict[str, Any], deps: dict[str, str], resident: str | None
) -> dict[str, JobSpec]:
    """{`seed=<s>`: the calibrate job of seed s}: the sweep's calibration with its seed shifted."""
    return {
        label(s): ctx.job("calibrate", {**params, "seed": params["seed"] + o}, deps, resident=resident)
        for s, o in offsets(ctx.spec).items()
    }


def repeat_config(cfg: dict[str, Any], seed: int, offset: int) -> dict[str, Any]:
    """A selected configuration's repeat with another seed: its axes, a key and variant label of its own."""
    base = cfg["config_key"]
    return {
        **cfg,
        "config_key": f"{base}|{label(seed)}",
        "variant": label(seed),
        "variant_of": base,
        "selected_for_distill": 1,
        "seed_offset": offset,
        "note": f"seed repeat of {base}: every seed of its chain + {offset}",
    }


def _picked(ctx: SweepContext) -> list[dict[str, Any]]:
    """The dense students the selection rule picked (not baselines, variants or DCDM mixtures)."""
    chosen = set(ctx.select())
    return [
        c
        for c in ctx.configs
        if c["config_key"] in chosen
        and c["kind"] == "moe2dense"  # a dense student
        and c.get("variant_of") is None
    ]


def convert_jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """Each pick's conversion again, on each repeat seed's calibration (the same parameters)."""
    if not offsets(ctx.spec) or ctx.select is None:
        return {}  # no repeats, or a dry run (planned once the selection is known)
    calib, convert = ctx.jobs.get("calibrate", {}), ctx.jobs.get("convert", {})
    out: dict[str, JobSpec] = {}
    repeats = []
    for cfg in _picked(ctx):
        main = convert.get(cfg["config_key"])
        if main is None:
            continue
        for s, o in offsets(ctx.spec).items():
            rep = repeat_config(cfg, s, o)
            repeats.append(rep)
            deps = {**main.deps, "calibrate": calib[label(s)].key}
            out[rep["config_key"]] = ctx.job("convert", main.params, deps, resident=main.resident)
    if repeats:
        ctx.add_configs(repeats)
    return out


def ppl_jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """The pre-distillation perplexity of each repeat whose conversion succeeded."""
    return {
        ck: ppl_job(ctx, ctx.config(ck), convert_stage="seed_convert")
        for ck in ctx.jobs.get("seed_convert", {})
        if ctx.succeeded("seed_convert", ck) is not None
    }


def after_ppl(ctx: SweepContext) -> None:
    """Each repeat records the content key of its conversion plan (equal to its main's when the calibration
    seed did not change the plan)."""
    ctx.set_fields(
        {
            ck: {"plan_key": ctx.succeeded("seed_convert", ck)["plan_key"]}
            for ck in ctx.jobs.get("seed_ppl", {})
        }
    )


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = len(offsets(ctx.spec))
    if not n:
        return []
    return [
        {
            "stage": "seed_convert",
            "named": "–",
            "distinct": "–",
            "note": f"{n} more seed(s) of each selected student (conversion, perplexity, distillation, "
            "evaluation), planned once the selection is known",
        }
    ]


CONVERT = Stage(
    name="seed_convert",
    run="workers.run.convert:stage_convert",
    jobs=convert_jobs,
    section="seeds",
    params=Seeds,
    upstream=("ppl_pre",),
    records=frozenset({"outputs", "plan_rows", "layer_diag", "artifacts"}),
    estimate=estimate,
    summary="the selected students' conversions on each further seed's calibration",
)

PPL = Stage(
    # not an identity stage: two seeds of a pick whose plan the calibration seed did not change share this job,
    # yet are distilled with different seeds, so neither is the other's duplicate
    name="seed_ppl",
    run="workers.run.ppl_pre:stage_ppl_pre",
    jobs=ppl_jobs,
    upstream=("seed_convert",),
    records=frozenset({"outputs", "metrics", "item_scores"}),
    after=after_ppl,
    estimate=lambda ctx, rows: [],
    summary="perplexity of each seed repeat before distillation",
)
