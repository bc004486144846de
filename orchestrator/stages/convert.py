"""convert: one conversion plan per configuration of the grid, stored as rows — for a dense output:
score → keep K → k groups → merge weights → α per layer; for a smaller MoE: score → keep K. The `grid`
section lists each axis's values (or is a list of such sub-grids, e.g. one per output); every
combination is a configuration.
"""

from __future__ import annotations

import json
from itertools import product
from typing import Annotated, Any

from pydantic import Discriminator, StrictInt, Tag, create_model, field_validator, model_validator

from db.axes import CONVERTED_KINDS, kind_of, method_axes
from orchestrator.axes import AXES, config_key
from orchestrator.schema import Strict, known
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


def _axis_validator(name: str):
    axis = AXES[name]

    def check(cls, v: list[Any] | None) -> list[Any] | None:
        if v is None:
            return v
        if not v:
            raise ValueError(f"{name} must be a non-empty list")
        if axis.kind is str:
            return known(v, axis.allowed(), name)
        if any(x < 1 for x in v):
            raise ValueError(f"{name} must be positive integers, got {v}")
        return known(v, v, name)  # no repeats

    return field_validator(name)(classmethod(check))


METHOD_AXES = method_axes()  # the axes whose value names a method that may take settings


class SubGrid(Strict):
    """One product of axis values; `grid:` is one of these or a list of them (their union).

    `settings` (optional) maps a method the sub-grid names (a scoring, merging or editing value) or one
    of its outputs to that method's settings, e.g. `{HC-SMoE: {linkage: single}, moe: {super_experts:
    10.0}}`; each configuration gets its output's and its method's settings (checked by the worker)."""

    settings: dict[str, dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _complete(self) -> SubGrid:
        outputs = self.output or list(AXES["output"].default)
        for name, axis in AXES.items():
            if not all(axis.applies(o) for o in outputs):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} does not apply to output {', '.join(outputs)}; it applies to "
                        f"{', '.join(axis.outputs or ())}: give it in a sub-grid of its own"
                    )
            elif getattr(self, name) is None:
                if axis.default is None:
                    raise ValueError(f"{name} is required")
                setattr(self, name, list(axis.default))
        named = [*outputs, *(m for a in METHOD_AXES for m in (getattr(self, a) or []))]
        unknown = sorted(set(self.settings or {}) - set(named))
        if unknown:
            raise ValueError(
                f"settings: {', '.join(unknown)} is not a method or output of this sub-grid; "
                f"allowed: {', '.join(named)}"
            )
        return self

    def config_settings(self, values: dict[str, Any]) -> str | None:
        """The settings of one configuration (its output's, then its method's) as sorted JSON, or None."""
        out: dict[str, Any] = {}
        for name in (values.get("output") or "dense", *(values.get(a) for a in METHOD_AXES)):
            out.update((self.settings or {}).get(name) or {})
        return json.dumps(out, sort_keys=True) if out else None


Grid = create_model(
    "Grid",
    __base__=SubGrid,
    __validators__={f"_{n}": _axis_validator(n) for n in AXES},
    **{n: (list[a.kind if a.kind is str else StrictInt] | None, None) for n, a in AXES.items()},
    # the name of a section of the sweep's `calibrations` that calibrates this sub-grid's configurations
    # (default: the `calibration` section; stages/calibrate.py)
    calibration=(str | None, None),
)


# `grid:` is one sub-grid or a list of them; the discriminator validates only the form given, so an error
# names the field that is wrong (the tags are left out of error locations: see spec._one_line)
GridSection = Annotated[
    Annotated[Grid, Tag("__one__")] | Annotated[list[Grid], Tag("__many__")],
    Discriminator(lambda v: "__many__" if isinstance(v, list) else "__one__"),
]


def subgrids(spec) -> list:
    return spec.grid if isinstance(spec.grid, list) else [spec.grid]


def grid_configs(spec, model: str, top_k: int | None) -> list[dict[str, Any]]:
    """Every combination of each sub-grid's axes, as configurations (`config_key` e.g. SF|RR|uniform|K=8).
    A configuration two sub-grids name must get the same settings from both (ValueError otherwise).
    A sub-grid's named `calibration` goes with its configurations (`calibration`: the name); one that
    sub-grids calibrate differently is one configuration per calibration, the named ones keyed
    `<config_key>|calibration=<name>` (stages/calibrate.py)."""
    combos: list[tuple[Any, dict[str, Any]]] = []
    for grid in subgrids(spec):
        names = [n for n in AXES if getattr(grid, n) is not None]
        for values in product(*(getattr(grid, n) for n in names)):
            combos.append((grid, {n: None for n in AXES} | dict(zip(names, values, strict=True))))
    calibrations: dict[str, set[str | None]] = {}
    for grid, axes in combos:
        calibrations.setdefault(config_key(axes), set()).add(grid.calibration)
    out: dict[str, dict[str, Any]] = {}
    for grid, axes in combos:
        key = plain = config_key(axes)
        if grid.calibration is not None and len(calibrations[plain]) > 1:
            key = f"{plain}|calibration={grid.calibration}"
        settings = grid.config_settings(axes)
        c = out.setdefault(
            key,
            {
                "config_key": key,
                "model": model,
                "kind": kind_of(axes.get("output")),
                "settings": settings,
                "teacher_variant": spec.teacher.variant,
                "top_k": top_k,
                **axes,
                **({"calibration": grid.calibration} if grid.calibration is not None else {}),
            },
        )
        if c["settings"] != settings:
            raise ValueError(
                f"grid: configuration {key} is in two sub-grids with different settings "
                f"({c['settings']} and {settings}); give each configuration one set"
            )
    return list(out.values())


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    from orchestrator.stages.dcdm import mixture

    tparams, tdeps, resident = teacher_ref(ctx)
    out = {}
    for c in ctx.configs:
        calib = ctx.jobs.get("calibrate", {}).get(c.get("dcdm_of") or c["config_key"])
        if c["kind"] not in CONVERTED_KINDS or calib is None:
            continue
        params = {
            "teacher": tparams,
            **{n: c[n] for n in AXES if c[n] is not None and not AXES[n].after_student},
        }
        if c.get("settings"):
            params["settings"] = json.loads(c["settings"])
        deps = {**tdeps, "calibrate": calib.key}
        maxima = ctx.jobs.get("expert_maxima", {}).get(c.get("dcdm_of") or c["config_key"])
        if maxima is not None:  # super_experts: reap reads the max activations
            deps["expert_maxima"] = maxima.key
        if c.get("dcdm_of") is not None:  # a DCDM mixture: the statistics mixed with its DCDM weights
            mix = mixture(ctx, c)
            if mix is None:
                continue  # its DCDM did not succeed: nothing downstream of it runs
            params["calibration_weights"], dcdm = mix
            # keyed by the weights (in params), not by the job that found them
            out[c["config_key"]] = ctx.job(
                "convert", params, {**deps, "dcdm": dcdm.key}, resident=resident, key_deps=deps
            )
            continue
        out[c["config_key"]] = ctx.job("convert", params, deps, resident=resident)
    return out


STAGE = Stage(
    name="convert",
    run="workers.run.convert:stage_convert",
    jobs=jobs,
    section="grid",
    params=GridSection,
    section_default="required",
    upstream=("calibrate", "dcdm", "expert_maxima"),
    records=frozenset({"outputs", "plan_rows", "layer_diag", "artifacts"}),
    summary="a conversion plan per configuration; equal plans are one student",
)
