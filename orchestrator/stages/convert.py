"""convert: one conversion plan per configuration of the grid (score → keep K → k groups → merge
weights → α per layer), stored as rows. The `grid` section lists each axis's values; every
combination is a configuration.
"""

from __future__ import annotations

from itertools import product
from typing import Any

from pydantic import StrictInt, create_model, field_validator

from orchestrator.axes import AXES
from orchestrator.schema import Strict, known
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


def _axis_validator(name: str):
    axis = AXES[name]

    def check(cls, v: list[Any]) -> list[Any]:
        if not v:
            raise ValueError(f"{name} must be a non-empty list")
        if axis.registry:
            return known(v, axis.allowed(), name)
        if any(x < 1 for x in v):
            raise ValueError(f"{name} must be positive integers, got {v}")
        return known(v, v, name)  # no repeats

    return field_validator(name)(classmethod(check))


Grid = create_model(
    "Grid", __base__=Strict,
    __validators__={f"_{n}": _axis_validator(n) for n in AXES},
    **{n: (list[a.kind if a.kind is str else StrictInt], list(a.default) if a.default else ...)
       for n, a in AXES.items()},
)


def grid_configs(spec, model: str, top_k: int | None) -> list[dict[str, Any]]:
    """Every combination of the grid's axes, as configurations (`config_key` e.g. SF|RR|uniform|K=8)."""
    grid = spec.grid
    out = []
    for values in product(*(getattr(grid, n) for n in AXES)):
        axes = dict(zip(AXES, values, strict=True))
        key = "|".join(f"{n}={v}" if AXES[n].kind is int else str(v) for n, v in axes.items())
        out.append({"config_key": key, "model": model, "kind": "moe2dense", "teacher_variant": spec.teacher.variant,
                    "top_k": top_k, **axes})
    return out


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    tparams, tdeps, resident = teacher_ref(ctx)
    out = {}
    for c in ctx.configs:
        calib = ctx.jobs.get("calibrate", {}).get(c["config_key"])
        if c["kind"] != "moe2dense" or calib is None:
            continue
        params = {"teacher": tparams, **{n: c[n] for n in AXES}}
        out[c["config_key"]] = ctx.job("convert", params, {**tdeps, "calibrate": calib.key}, resident=resident)
    return out


STAGE = Stage(
    name="convert", run="workers.stages:stage_convert", jobs=jobs, section="grid", params=Grid,
    section_default="required", upstream=("calibrate",),
    records=frozenset({"outputs", "plan_rows", "layer_diag", "artifacts"}),
    summary="a conversion plan per configuration; equal plans are one student")
