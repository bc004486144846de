"""dot_moe: dense → MoE by DOT-MoE ("DOT-MoE: Differentiable Optimal Transport for MoEfication"): the
FFNs of a dense model split into E experts by a learned balanced neuron assignment and a top-k router
(only those train; the dense weights stay frozen), extracted as a real MoE checkpoint and evaluated by
perplexity at several top-k (the paper's inference-sparsity sweep, Table 8).

Which dense models (`dense_models`; not `on`, which YAML reads as true): `dense_teacher`, the sweep's dense teacher (the dense-to-dense baseline's), and
`distilled`, every dense student the sweep distilled (the MoE → dense → MoE path). Each (method, E, k,
dense model) is a configuration of kind `dense2moe` with key e.g. `dense2moe|dot|dense_teacher|E=8|k=2`
or `dense2moe|random|distilled:SF|RR|uniform|K=2|E=8|k=2`; `K` holds E, `top_k` the trained k, `settings`
(JSON) the method, the dense model it came from and the alignment settings.

The paper's dense → MoE baselines built without training (`baselines`: CMoE, LLaMA-MoE-v2, each at its
own E, k and S shared experts, e.g. CMoE's E8A1S1) are configurations of the same kind and stage, keyed
`dense2moe|cmoe|dense_teacher|E=8|S=1|k=1` (`|S=…` only with shared experts); `K` = E counting the shared
experts, `top_k` = the routed k, `settings` adds `shared` and the calibration (`baseline_settings`).
Every dense2moe configuration names its method in `baseline` (DOT-MoE, random split, weight clustering,
CMoE, LLaMA-MoE-v2), as the DOT-MoE paper's imported rows do.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field, StrictInt, field_validator, model_validator

from orchestrator.schema import Data, PosInt, SpecError, Strict, known, worker_settings
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref

SOURCES = ("dense_teacher", "distilled")
METHODS = ("dot", "random", "cluster")  # = workers.baselines.dot_moe_spec.METHODS (checked by a test)
BASELINES = ("cmoe", "llama_moe_v2")  # = workers.baselines.dot_moe_spec.BASELINES (checked by a test)
LABELS = {  # a dense2moe configuration's `baseline` column
    "dot": "DOT-MoE",
    "random": "random split",
    "cluster": "weight clustering",
    "cmoe": "CMoE",
    "llama_moe_v2": "LLaMA-MoE-v2",
}


class Baseline(Strict):
    """One configuration of a baseline built without training: E experts of which `shared` are always on,
    `top_k` of the E − shared routed ones per token (the papers' E8A1S1: experts 8, shared 1, top_k 1)."""

    method: str  # cmoe | llama_moe_v2
    experts: PosInt
    top_k: PosInt
    shared: Annotated[StrictInt, Field(ge=0)] = 0
    eval_top_k: list[PosInt] = Field(default_factory=list)  # default: the section's (k > E − shared skipped)

    @field_validator("method")
    @classmethod
    def _method(cls, v: str) -> str:
        return known([v], BASELINES, "baseline method")[0]

    @model_validator(mode="after")
    def _sizes(self) -> Baseline:
        routed = self.experts - self.shared
        if routed < 1 or self.top_k > routed:
            raise ValueError(
                f"{self.method}: top_k {self.top_k} with {self.shared} shared of {self.experts} experts: "
                "need 1 <= top_k <= experts - shared"
            )
        return self


class DotMoe(Strict):
    experts: list[PosInt] = Field(default_factory=lambda: [8])  # E per FFN (s = d_ffn / E)
    top_k: list[PosInt] = Field(default_factory=lambda: [2])  # experts a token uses in training
    methods: list[str] = Field(default_factory=lambda: ["dot"])  # dot | random | cluster
    dense_models: list[str] = Field(default_factory=lambda: ["dense_teacher"])  # dense_teacher | distilled
    settings: dict[str, Any] = Field(default_factory=dict)  # workers.baselines.dot_moe_spec.DotMoeSpec fields
    data: Data = Field(default_factory=Data)  # alignment text (the paper: Dolmino-mix)
    eval_top_k: list[PosInt] = Field(default_factory=list)  # perplexity also at these k (k > E skipped)
    baselines: list[Baseline] = Field(default_factory=list)  # CMoE / LLaMA-MoE-v2 configurations
    baseline_settings: dict[str, Any] = Field(default_factory=dict)  # D2mBaselineSpec fields (not shared)

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        for m in v:
            if m in BASELINES:
                raise ValueError(
                    f"method {m!r} is built without training: list it under dot_moe.baselines as "
                    "{method, experts, top_k, shared}"
                )
        return known(v, METHODS, "method")

    @field_validator("baseline_settings")
    @classmethod
    def _baseline_settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.baselines.dot_moe_spec import D2mBaselineSpec

        if "shared" in v:
            raise ValueError("shared: set per configuration in dot_moe.baselines, not in baseline_settings")
        return worker_settings(D2mBaselineSpec, v)

    @field_validator("dense_models")
    @classmethod
    def _dense_models(cls, v: list[str]) -> list[str]:
        return known(v, SOURCES, "dense model")

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.baselines.dot_moe_spec import DotMoeSpec

        if "baseline" in v:
            raise ValueError("baseline: set per job from dot_moe.baselines and baseline_settings")
        return worker_settings(DotMoeSpec, v)

    @model_validator(mode="after")
    def _k(self) -> DotMoe:
        for name in ("experts", "top_k", "dense_models") + (() if self.baselines else ("methods",)):
            if not getattr(self, name):
                raise ValueError(f"{name}: needs at least one value")
        seen = set()
        for b in self.baselines:
            key = (b.method, b.experts, b.shared, b.top_k)
            if key in seen:
                raise ValueError(
                    f"baselines: {b.method} E={b.experts} S={b.shared} k={b.top_k} is listed twice"
                )
            seen.add(key)
        if self.methods and max(self.top_k) > min(self.experts):
            raise ValueError(f"top_k {max(self.top_k)} exceeds experts {min(self.experts)}: need top_k <= E")
        return self


def config_key(method: str, source: str, experts: int, k: int, shared: int = 0) -> str:
    return f"dense2moe|{method}|{source}|E={experts}" + (f"|S={shared}" if shared else "") + f"|k={k}"


def _dense_source(ctx: SweepContext) -> list[dict[str, Any]]:
    t = ctx.spec.dense_teacher
    if t is None:
        raise SpecError("dot_moe.dense_models: dense_teacher needs a dense_teacher section")
    tparams, tdeps, resident = teacher_ref(ctx, "dense_teacher")
    label = t.label or (t.model.rstrip("/").split("/")[-1] if t.model else "tiny-dense")
    return [
        {
            "name": "dense_teacher",
            "params": {"type": "dense_teacher", "teacher": tparams, "dense_teacher": tparams},
            "deps": tdeps,
            "resident": resident,
            "model": label,
            "of": None,
        }
    ]


def _distilled_sources(ctx: SweepContext) -> list[dict[str, Any]]:
    """Every dense student the sweep distilled and that succeeded (one per distillation job)."""
    from orchestrator.stages.teacher import teacher_label

    done = ctx.outputs.get("distill", {})
    seen: set[str] = set()
    out = []
    for ck, job in ctx.jobs.get("distill", {}).items():
        student = job.params["student"]
        if job.key not in done or job.key in seen or student.get("output", "dense") != "dense":
            continue
        seen.add(job.key)
        which = "dense_teacher" if student["type"] == "d2d" else "teacher"
        tparams, tdeps, _ = teacher_ref(ctx, which)  # its dtype; a tiny corpus is read beside the teacher
        out.append(
            {
                "name": f"distilled:{ck}",
                "params": {"type": "distilled", "teacher": tparams},
                "deps": {"distill": job.key, **tdeps},
                "resident": None,
                "model": teacher_label(ctx.spec),
                "of": ck,
            }
        )
    return out


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    d = getattr(ctx.spec, "dot_moe", None)
    if d is None:
        return {}
    sources = (_dense_source(ctx) if "dense_teacher" in d.dense_models else []) + (
        _distilled_sources(ctx) if "distilled" in d.dense_models else []
    )
    out: dict[str, JobSpec] = {}
    configs = []
    for src in sources:
        for method in d.methods:
            for e in d.experts:
                for k in d.top_k:
                    ks = sorted({k, *(x for x in d.eval_top_k if x <= e)})
                    params = {
                        **{kk: v for kk, v in src["params"].items() if kk != "type"},
                        "source": src["params"]["type"],
                        "method": method,
                        "experts": e,
                        "top_k": k,
                        "eval_top_k": ks,
                        "settings": d.settings,
                        "data": d.data.model_dump(),
                        "ppl": ctx.spec.ppl.model_dump(),
                    }
                    ck = config_key(method, src["name"], e, k)
                    out[ck] = ctx.job("dot_moe", params, src["deps"], resident=src["resident"])
                    configs.append(_config(ck, src, method, e, k, ks, d.settings))
        for b in d.baselines:
            out_ck, job, cfg = _baseline_job(ctx, d, src, b)
            out[out_ck] = job
            configs.append(cfg)
    if configs and ctx.add_configs is not None:
        ctx.add_configs(configs)
    return out


def _baseline_job(ctx: SweepContext, d: DotMoe, src: dict[str, Any], b: Baseline):
    """(config key, job, configuration) of one baseline built without training on one dense model."""
    from workers.baselines.dot_moe_spec import baseline_job_settings

    settings = baseline_job_settings(b.method, b.experts, b.top_k, b.shared, d.baseline_settings)
    routed = b.experts - b.shared
    ks = sorted({b.top_k, *(x for x in (b.eval_top_k or d.eval_top_k) if x <= routed)})
    params = {
        **{kk: v for kk, v in src["params"].items() if kk != "type"},
        "source": src["params"]["type"],
        "method": b.method,
        "experts": b.experts,
        "top_k": b.top_k,
        "eval_top_k": ks,
        "settings": settings,
        "data": d.data.model_dump(),
        "ppl": ctx.spec.ppl.model_dump(),
    }
    ck = config_key(b.method, src["name"], b.experts, b.top_k, b.shared)
    job = ctx.job("dot_moe", params, src["deps"], resident=src["resident"])
    return ck, job, _config(ck, src, b.method, b.experts, b.top_k, ks, settings, b.shared)


def _config(
    ck: str,
    src: dict[str, Any],
    method: str,
    e: int,
    k: int,
    ks: list[int],
    settings: dict[str, Any],
    shared: int = 0,
) -> dict[str, Any]:
    """A dense2moe configuration: K = E experts (shared ones counted), top_k = the trained (routed) k,
    `baseline` = the method's name; the rest in `settings`."""
    from workers.baselines.dot_moe_spec import DotMoeSpec

    combine = DotMoeSpec(**settings).combine
    meta = {
        "method": method,
        "source": src["name"].split(":")[0],
        "source_config": src["of"],
        "experts": e,
        "top_k": k,
        "eval_top_k": ks,
        "combine": combine,
        "settings": settings,
    }
    if method in BASELINES:
        meta["shared"] = shared
        note = (
            f"{LABELS[method]} of {src['name']}: {e} experts ({shared} shared, always on), top-{k} of the "
            f"{e - shared} routed, {combine} combine, built without training"
        )
    else:
        note = f"DOT-MoE ({method}) of {src['name']}: {e} experts, top-{k}, {combine} combine"
    return {
        "config_key": ck,
        "model": src["model"],
        "kind": "dense2moe",
        "baseline": LABELS[method],
        "K": e,
        "top_k": k,
        "settings": json.dumps(meta, sort_keys=True),
        "note": note,
    }


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    d = getattr(ctx.spec, "dot_moe", None)
    if d is None:
        return []
    per = len(d.methods) * len(d.experts) * len(d.top_k) + len(d.baselines)
    n_dense = per if "dense_teacher" in d.dense_models else 0
    if n_dense and ctx.spec.dense_teacher is None:
        raise SpecError("dot_moe.dense_models: dense_teacher needs a dense_teacher section")
    distilled = (
        next((r["named"] for r in rows if r["stage"] == "distill"), 0) if "distilled" in d.dense_models else 0
    )
    n = n_dense + per * distilled
    note = (
        f"{per} per dense model (methods × E × k"
        + (f", {len(d.baselines)} baselines built without training)" if d.baselines else ")")
        + (" on the dense teacher" if n_dense else "")
        + (f" and at most {distilled} distilled dense students" if distilled else "")
    )
    return [{"stage": "dot_moe", "named": n, "distinct": n, "note": note}] if n else []


STAGE = Stage(
    name="dot_moe",
    run="workers.run.dot_moe:stage_dot_moe",
    jobs=jobs,
    section="dot_moe",
    params=DotMoe,
    upstream=("distill", "dense_teacher"),
    records=frozenset({"outputs", "metrics", "artifacts"}),
    estimate=estimate,
    summary="dense → MoE by DOT-MoE (learned balanced neuron → expert assignment) and the baselines "
    "CMoE and LLaMA-MoE-v2, perplexity at several top-k",
)
