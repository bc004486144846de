"""router_kd: retrain only the routers of a smaller MoE against the teacher (the Router KD paper, §4:
forward KL of the next-token distributions, padding-masked, per sequence; experts, attention and
everything else frozen), for every configuration whose `recovery` is `router_kd`. Its result is a router
delta that evaluation applies to the student it was trained from.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from orchestrator.schema import Data, Strict, worker_settings
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


class RouterKD(Strict):
    settings: dict[str, Any] = Field(
        default_factory=dict
    )  # workers.training.router_kd_spec.RouterKDSpec fields
    data: Data = Field(default_factory=Data)  # its calibration text (the paper: C4)

    @field_validator("settings")
    @classmethod
    def _settings(cls, v: dict[str, Any]) -> dict[str, Any]:
        from workers.training.router_kd_spec import RouterKDSpec

        return worker_settings(RouterKDSpec, v)


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    tparams, tdeps, resident = teacher_ref(ctx)
    out = {}
    for c in ctx.configs:
        ppl = ctx.jobs.get("ppl_pre", {}).get(c["config_key"])
        if (
            c.get("recovery") != "router_kd"
            or ppl is None
            or ctx.succeeded("ppl_pre", c["config_key"]) is None
        ):
            continue
        r = ctx.spec.router_kd
        params = {
            "teacher": tparams,
            "student": ppl.params["student"],
            "settings": r.settings,
            "data": r.data.model_dump(),
        }
        deps = {**ppl.deps, **tdeps}
        out[c["config_key"]] = ctx.job(
            "router_kd",
            params,
            deps,
            resident=resident,
            key_deps={k: v for k, v in deps.items() if k != "convert"},
        )
    return out


def estimate(ctx: SweepContext, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = sum(1 for c in ctx.configs if c.get("recovery") == "router_kd")
    return (
        [
            {
                "stage": "router_kd",
                "named": n,
                "distinct": n,
                "note": "routers of each smaller MoE with recovery router_kd",
            }
        ]
        if n
        else []
    )


STAGE = Stage(
    name="router_kd",
    run="workers.run.router_kd:stage_router_kd",
    jobs=jobs,
    section="router_kd",
    params=RouterKD,
    section_default="default",
    upstream=("ppl_pre",),
    records=frozenset({"outputs", "metrics", "artifacts"}),
    estimate=estimate,
    summary="retrain only the routers of a smaller MoE against the teacher (Router KD)",
)
