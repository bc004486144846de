"""distill: knowledge distillation of the selected students from their teacher (§3.5, §4.3).

Which configurations are distilled is the sweep's selection rule (`select`, stored with the sweep),
applied to the pre-distillation results; the d2d baseline distills its best candidate; every smaller MoE
whose `recovery` is `full_kd` is distilled too (all its parameters trained, the same loss and settings). `variants`
are extra runs with overridden settings (e.g. another loss, expanded teacher routing k′) on the
selected configurations that match `variants_on`: each is a configuration of its own with a
`variant` label and `variant_of` pointing at the configuration it varies. Seed repeats of the selected
students (`seeds`, stages/seeds.py) are distilled with `seed` shifted by their offset. `search` searches
the settings on the selected configurations (orchestrator/search.py): each trial a configuration
`<key>|search=<n>` whose distill jobs (one per rung) run while this stage plans.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from db.axes import CONVERTED_KINDS, recovered_by
from orchestrator.schema import Data, Strict, worker_settings
from orchestrator.search import Search, estimate_note, plan_trials, searched_bases
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


class Distill(Strict):
    settings: dict[str, Any] = Field(default_factory=dict)  # workers.training.distill_spec.DistillSpec fields
    data: Data = Field(default_factory=Data)
    val_data: Data = Field(default_factory=lambda: Data(split="valid"))
    variants: list[dict[str, Any]] = Field(default_factory=list)  # extra runs: overrides of settings
    variants_on: dict[str, Any] = Field(default_factory=dict)  # which selected configs get them
    # data-parallel processes per distillation job: 1, N, or "gpus" (one per GPU the job holds; torchrun)
    processes: int | Literal["gpus"] = 1
    # none: one process; ddp: replicas (workers/training/ddp.py); fsdp: student and teacher sharded (workers/training/fsdp.py).
    # Unset: none for one process, ddp above (and then it is not part of the job, so keys stay as they were)
    sharding: Literal["none", "ddp", "fsdp"] | None = None
    teacher_offload: bool = False  # fsdp only: the teacher's shards stay in host memory between layers
    search: Search | None = (
        None  # a search over these settings on the selected configurations (orchestrator/search.py)
    )

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.training.distill_spec import DistillSpec

        return worker_settings(DistillSpec, v)

    @model_validator(mode="after")
    def _variants(self) -> Distill:
        from workers.training.distill_spec import DistillSpec

        for i, v in enumerate(self.variants):  # a variant is the settings with its overrides
            worker_settings(DistillSpec, {**self.settings, **v}, f"variants.{i}")
        return self

    @field_validator("search")
    @classmethod
    def _search(cls, v: Search | None, info: ValidationInfo) -> Search | None:
        """The search read against the settings (validated before it; their own error otherwise)."""
        settings = info.data.get("settings")
        return v if v is None or settings is None else v.checked(settings)

    @field_validator("processes")
    @classmethod
    def _procs(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"must be >= 1 or 'gpus', got {v}")
        return v

    @model_validator(mode="after")
    def _sharding(self) -> Distill:
        if self.sharding == "none" and self.processes != 1:
            raise ValueError(
                f"sharding: 'none' runs one process; processes must be 1, got {self.processes!r}"
            )
        if self.teacher_offload and self.sharding != "fsdp":
            raise ValueError(f"teacher_offload: needs sharding: fsdp, got sharding: {self.sharding}")
        return self

    def sharding_params(self) -> dict[str, Any]:
        """The job params of the sharding settings: only those a sweep sets, so existing job keys stay."""
        out: dict[str, Any] = {}
        if self.sharding is not None:
            out["sharding"] = self.sharding
        if self.teacher_offload:
            out["teacher_offload"] = True
        return out


def variant_label(overrides: dict[str, Any]) -> str:
    """`loss=reverse_kl`, `teacher_top_k=16`, `steps=400,tau=2.0`: what a variant run changes."""
    return ",".join(f"{k}={overrides[k]}" for k in sorted(overrides))


def distill_job(ctx: SweepContext, ppl: JobSpec, overrides: dict[str, Any]) -> JobSpec:
    student = ppl.params["student"]
    which = "dense_teacher" if student["type"] == "d2d" else "teacher"  # d2d: from its own dense teacher
    tparams, tdeps, resident = teacher_ref(ctx, which)
    d = ctx.spec.distill
    deps = {**ppl.deps, **tdeps}
    params = {
        "teacher": tparams,
        "student": student,
        "teacher_of_student": ppl.params["teacher"],
        "settings": {**d.settings, **overrides},
        "data": d.data.model_dump(),
        "val_data": d.val_data.model_dump(),
        "processes": d.processes,
        **d.sharding_params(),
    }
    return ctx.job(
        "distill", params, deps, resident=resident, key_deps={k: v for k, v in deps.items() if k != "convert"}
    )


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    from orchestrator.configs import distill_tokens

    d = ctx.spec.distill
    if d is None:
        return {}
    ppl = ctx.jobs.get("ppl_pre", {})
    out: dict[str, JobSpec] = {}
    variants: list[dict[str, Any]] = []
    for ck in ctx.select():
        if ck not in ppl:
            continue
        out[ck] = distill_job(ctx, ppl[ck], {})
        cfg = ctx.config(ck)
        for i, over in enumerate(d.variants):
            if not all(cfg.get(a) == v for a, v in d.variants_on.items()):
                continue
            vk = f"{ck}|variant={i}"
            variants.append(
                {
                    **cfg,
                    "config_key": vk,
                    "selected_for_distill": 1,
                    "variant": variant_label(over),
                    "variant_of": ck,
                    "distill_loss": over.get("loss"),
                    "teacher_top_k": over.get("teacher_top_k"),
                }
            )
            out[vk] = distill_job(ctx, ppl[ck], over)
    full = [
        c["config_key"]
        for c in ctx.configs
        if recovered_by(c) == "distill"
        and c["config_key"] in ppl
        and ctx.succeeded("ppl_pre", c["config_key"]) is not None
    ]
    for ck in full:  # a smaller MoE recovered by full KD: every one, whatever the selection rule
        out[ck] = distill_job(ctx, ppl[ck], {})
    seed = d.settings.get("seed", 0)
    for ck, job in ctx.jobs.get("seed_ppl", {}).items():  # seed repeats: the data order shifted too
        out[ck] = distill_job(ctx, job, {"seed": seed + ctx.config(ck)["seed_offset"]})
    if variants:
        ctx.add_configs(variants)
    if d.search is not None:  # its rungs run now, each a round of distill jobs (orchestrator/search.py)
        trials = searched_bases(ctx, [ck for ck in ctx.select() if ck in out], ppl)
        out.update(plan_trials(ctx, trials, lambda job, over: distill_job(ctx, job, over)))
    ctx.set_fields(
        {
            ck: {
                "distill_tokens": distill_tokens(j.params["settings"]),
                **({"selected_for_distill": 1} if ck in full else {}),
            }
            for ck, j in out.items()
        }
    )
    return out


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from itertools import product

    spec = ctx.spec
    if spec.distill is None:
        return []
    moe = [c for c in ctx.configs if c["kind"] == "moe2dense"]  # the dense students
    full = sum(1 for c in ctx.configs if recovered_by(c) == "distill")
    others = [c for c in ctx.configs if c["kind"] not in CONVERTED_KINDS]
    sel = spec.select
    groups = len(set(product(*[sorted({str(c[a]) for c in moe}) for a in sel.per]))) if sel else len(moe)
    base = sum(1 for c in others if c["kind"] == "baseline" and not c["baseline"].startswith("d2d:"))
    d2d = int(any(c["kind"] == "baseline" and c["baseline"].startswith("d2d:") for c in others))
    variants = len(spec.distill.variants)
    trials, trial_jobs, searched, evaluated = (0, 0, "", 0)
    if spec.distill.search is not None:
        trials, trial_jobs, searched = estimate_note(
            spec.distill.search, spec.distill.settings, groups + base + d2d
        )
        evaluated = (groups + base + d2d) * spec.distill.search.evaluated(spec.distill.settings)
    repeats = max(len(getattr(spec, "seeds", None) or []) - 1, 0)
    rule = f"best {sel.best_by} per {'×'.join(sel.per)} over {', '.join(sel.over)}" if sel else "all"
    n = groups + base + d2d + full
    return [
        {"stage": "select", "named": len(moe), "distinct": groups, "note": rule},
        {
            "stage": "distill",
            "named": n + variants + trials,
            "distinct": n + variants + trial_jobs,
            "evaluated": n
            + variants
            + evaluated,  # what the evaluate stage evaluates of these (its estimate)
            "note": f"{groups} selected + {base + d2d} baselines"
            + (f" + {full} smaller MoEs (full_kd)" if full else "")
            + (f" + up to {variants} variant runs" if variants else "")
            + (f" + {searched}" if searched else "")
            + (f" + {repeats} seed repeats of each selected student" if repeats else ""),
        },
    ]


STAGE = Stage(
    name="distill",
    run="workers.run.distill:stage_distill",
    jobs=jobs,
    section="distill",
    params=Distill,
    upstream=("ppl_pre", "seed_ppl"),
    records=frozenset({"outputs", "metrics", "artifacts"}),
    estimate=estimate,
    summary="distill the selected students (and baselines) from their teacher",
)
