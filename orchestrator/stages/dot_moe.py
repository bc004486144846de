"""dot_moe: dense → MoE by DOT-MoE ("DOT-MoE: Differentiable Optimal Transport for MoEfication"): the
FFNs of a dense model split into E experts by a learned balanced neuron assignment and a top-k router
(only those train; the dense weights stay frozen), extracted as a real MoE checkpoint and evaluated by
perplexity at several top-k (the paper's inference-sparsity sweep, Table 8).

Which dense models (`dense_models`; not `on`, which YAML reads as true): `dense_teacher`, the sweep's dense teacher (the dense-to-dense baseline's), and
`distilled`, every dense student the sweep distilled (the MoE → dense → MoE path). Each (method, E, k,
dense model) is a configuration of kind `dense2moe` with key e.g. `dense2moe|dot|dense_teacher|E=8|k=2`
or `dense2moe|random|distilled:SF|RR|uniform|K=2|E=8|k=2`; `K` holds E, `top_k` the trained k, `settings`
(JSON) the method, the dense model it came from and the alignment settings.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator

from orchestrator.schema import Data, PosInt, SpecError, Strict, known, worker_settings
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref

SOURCES = ("dense_teacher", "distilled")
METHODS = ("dot", "random", "cluster")  # = workers.baselines.dot_moe_spec.METHODS (checked by a test)


class DotMoe(Strict):
    experts: list[PosInt] = Field(default_factory=lambda: [8])  # E per FFN (s = d_ffn / E)
    top_k: list[PosInt] = Field(default_factory=lambda: [2])  # experts a token uses in training
    methods: list[str] = Field(default_factory=lambda: ["dot"])  # dot | random | cluster
    dense_models: list[str] = Field(default_factory=lambda: ["dense_teacher"])  # dense_teacher | distilled
    settings: dict[str, Any] = Field(default_factory=dict)  # workers.baselines.dot_moe_spec.DotMoeSpec fields
    data: Data = Field(default_factory=Data)  # alignment text (the paper: Dolmino-mix)
    eval_top_k: list[PosInt] = Field(default_factory=list)  # perplexity also at these k (k > E skipped)

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        return known(v, METHODS, "method")

    @field_validator("dense_models")
    @classmethod
    def _dense_models(cls, v: list[str]) -> list[str]:
        return known(v, SOURCES, "dense model")

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.baselines.dot_moe_spec import DotMoeSpec

        return worker_settings(DotMoeSpec, v)

    @model_validator(mode="after")
    def _k(self) -> DotMoe:
        for name in ("experts", "top_k", "methods", "dense_models"):
            if not getattr(self, name):
                raise ValueError(f"{name}: needs at least one value")
        if max(self.top_k) > min(self.experts):
            raise ValueError(f"top_k {max(self.top_k)} exceeds experts {min(self.experts)}: need top_k <= E")
        return self


def config_key(method: str, source: str, experts: int, k: int) -> str:
    return f"dense2moe|{method}|{source}|E={experts}|k={k}"


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
    if configs and ctx.add_configs is not None:
        ctx.add_configs(configs)
    return out


def _config(
    ck: str, src: dict[str, Any], method: str, e: int, k: int, ks: list[int], settings: dict[str, Any]
) -> dict[str, Any]:
    """A dense2moe configuration: K = E experts, top_k = the trained k; the rest in `settings`."""
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
    return {
        "config_key": ck,
        "model": src["model"],
        "kind": "dense2moe",
        "K": e,
        "top_k": k,
        "settings": json.dumps(meta, sort_keys=True),
        "note": f"DOT-MoE ({method}) of {src['name']}: {e} experts, top-{k}, {combine} combine",
    }


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    d = getattr(ctx.spec, "dot_moe", None)
    if d is None:
        return []
    per = len(d.methods) * len(d.experts) * len(d.top_k)
    n_dense = per if "dense_teacher" in d.dense_models else 0
    if n_dense and ctx.spec.dense_teacher is None:
        raise SpecError("dot_moe.dense_models: dense_teacher needs a dense_teacher section")
    distilled = (
        next((r["named"] for r in rows if r["stage"] == "distill"), 0) if "distilled" in d.dense_models else 0
    )
    n = n_dense + per * distilled
    note = (
        f"{per} per dense model (methods × E × k)"
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
    summary="dense → MoE by DOT-MoE (learned balanced neuron → expert assignment), "
    "perplexity at several top-k",
)
