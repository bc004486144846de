"""dcdm: Dynamic Calibration Dataset Mixing ("Compressing Large MoE Models via Efficient Pruning and
Data-Aware Calibration", §4.2, Algorithm 2) for the configurations it applies to.

One job per configuration (its output, method, K and settings; configurations that differ only in
`recovery` share it): from the calibration's per-source statistics, repeatedly compress the teacher with
the configuration's own method on the current mix, measure each domain's discrepancy on held-out data
and move the mix toward the domains served worst (workers/calibration/dcdm.py). Every round's weights and
discrepancies are metric rows of the configuration (`dcdm_weight`, `dcdm_discrepancy`, `dcdm_ppl`,
`dcdm_samples`; `task` = the source, `step` = the round).

The final mix is a configuration of its own, `<config_key>|calibration=dcdm` (variant
`calibration=dcdm`, `variant_of` its base), converted from the same statistics mixed with the DCDM weights
and evaluated downstream like any other (ppl_pre, router_kd, evaluate): unlike a distillation variant,
which shares its base's student, it has a conversion of its own. As a variant it never competes with its
base in the selection rule.

The settings (w0, metric, temperature, max_iters, tol, n_eval, seq_len, batch_size, seed) are declared once,
by workers.calibration.dcdm_spec.DCDMSpec, and checked by it (worker_settings, as distill's): they are keys of the
section itself, beside its own `held_out` and `apply_to`; `seq_len` unset is calibration.seq_len.

Section absent: no jobs. `held_out` defaults to each source's own data with, for the tiny corpus, the
`valid` split in place of `train` (its domain kept); a jsonl or hf source keeps its data and is sampled
with the `seed` of this section, so its held-out windows may overlap the calibration windows: name a
held-out split in `held_out` for a clean one.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from db.axes import CONVERTED_KINDS
from orchestrator.axes import AXES
from orchestrator.schema import Data, SpecError, Strict, typed_setting, worker_settings
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.expert_maxima import wants_maxima
from orchestrator.stages.teacher import teacher_ref

SUFFIX = "calibration=dcdm"  # the variant label, and the tail of a DCDM mixture's configuration key


def dcdm_spec() -> type:
    """The settings of a DCDM run and their checks (workers.calibration.dcdm_spec, torch-free)."""
    from workers.calibration.dcdm_spec import DCDMSpec

    return DCDMSpec


def _at(key: str, error: ValueError, value: Any, given: Any) -> InitErrorDetails:
    """The error of the section's key `key`, one line `dcdm.<key>: <what> (got <given>)`: DCDMSpec's
    `key=value: what` without its `key=value` (the line names both already)."""
    what = str(error).removeprefix(f"{key}={value!r}: ")
    return InitErrorDetails(
        type=PydanticCustomError("value_error", f"{what} (got {given!r})"), loc=(key,), input=given
    )


class DCDM(Strict):
    # DCDMSpec's fields (w0, metric, temperature, max_iters, tol, n_eval, seq_len, batch_size, seed): keys of
    # the section itself in the sweep file, kept here complete (DCDMSpec's defaults filled, an integer of a
    # float field a float) in DCDMSpec's order, as the job parameters take them. seq_len None: calibration.seq_len
    settings: dict[str, Any]
    held_out: dict[str, Data] | None = None  # source name -> its held-out data
    # axis -> value (or list of values): the configurations DCDM runs on (not `on`: YAML reads it as true)
    apply_to: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _settings(cls, data: Any) -> Any:
        """Split the section's DCDMSpec keys off into `settings`, each checked by DCDMSpec itself
        (worker_settings) and then typed as strictly as a schema field is (typed_setting: no boolean
        for a number, an integer of a float field made a float, as pydantic did)."""
        if not isinstance(data, dict):
            return data  # pydantic reports it
        if "settings" in data:  # the settings are the section's own keys, never a `settings` key
            raise ValidationError.from_exception_data(
                cls.__name__,
                [InitErrorDetails(type="extra_forbidden", loc=("settings",), input=data["settings"])],
            )
        spec = dcdm_spec()
        names = [f.name for f in dataclasses.fields(spec)]
        settings: dict[str, Any] = {}
        errors: list[InitErrorDetails] = []
        for f in dataclasses.fields(spec):
            given = data.get(f.name)
            if f.name == "seq_len" and given is None:
                settings[f.name] = None  # calibration.seq_len, not DCDMSpec's default
                continue
            value = data.get(f.name, f.default)  # DCDMSpec has a default for each
            try:
                try:  # DCDMSpec's own check (the other fields at its defaults), then the type of the field
                    worker_settings(spec, {f.name: value})
                except OverflowError:  # an integer too large for a float: typed_setting says so
                    pass
                value = typed_setting(spec, f.name, value)
            except ValueError as e:
                errors.append(_at(f.name, e, value, given))
            settings[f.name] = value
        if errors:
            raise ValidationError.from_exception_data(cls.__name__, errors)
        # the whole once more, for a check of several fields (an error of the section: `dcdm: ...`)
        worker_settings(spec, {k: v for k, v in settings.items() if v is not None})
        return {**{k: v for k, v in data.items() if k not in names}, "settings": settings}

    @field_validator("apply_to")
    @classmethod
    def _apply_to(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name, value in v.items():
            if name not in AXES:
                raise ValueError(f"{name!r} is not an axis; allowed: {', '.join(AXES)}")
            values = value if isinstance(value, list) else [value]
            if not values or any(not isinstance(x, str | int) or isinstance(x, bool) for x in values):
                raise ValueError(f"{name}: a value or a non-empty list of values, got {value!r}")
        return v

    @field_validator("held_out")
    @classmethod
    def _tiny_domains(cls, v: dict[str, Data] | None) -> dict[str, Data] | None:
        from workers.core.data import tiny_split_error

        for name, data in (v or {}).items():
            error = tiny_split_error(data.source, data.split)
            if error:
                raise ValueError(f"{name}: {error}")
        return v


def _with_calibration(v: DCDM, info: ValidationInfo) -> DCDM:
    """The section read against the calibration section (validated before it): DCDM needs two named
    sources, and `held_out` may name only those."""
    calibration = info.data.get("calibration")
    if calibration is None:
        return v  # the calibration section itself is wrong: its own error is reported
    sources = calibration.sources or {}
    if len(sources) < 2:
        raise ValueError("needs calibration.sources with at least 2 named sources (DCDM mixes domains)")
    unknown = sorted(set(v.held_out or {}) - set(sources))
    if unknown:
        raise ValueError(
            f"held_out: {', '.join(map(repr, unknown))} is not a calibration source; "
            f"allowed: {', '.join(sources)}"
        )
    return v


DCDMSection = Annotated[DCDM, AfterValidator(_with_calibration)]


# ---- planning ------------------------------------------------------------------------------------
def held_out_data(data: Data) -> dict[str, Any]:
    """The default held-out data of a calibration source: for the tiny corpus its `valid` split (the
    same domain); any other source unchanged (then only the sampling seed differs)."""
    d = data.model_dump()
    if d["source"] == "tiny":
        split, _, domain = d["split"].partition(":")
        d["split"] = "valid" + (f":{domain}" if domain else "") if split == "train" else d["split"]
    return d


def matches(cfg: dict[str, Any], apply_to: dict[str, Any]) -> bool:
    return all(cfg.get(a) in (v if isinstance(v, list) else [v]) for a, v in apply_to.items())


def dcdm_params(ctx: SweepContext, cfg: dict[str, Any]) -> dict[str, Any]:
    """A configuration's DCDM job parameters: its conversion (as a convert job's, without the axes that
    change a student after conversion), the settings and held-out data, and the calibration's sample count."""
    d, calibration = ctx.spec.dcdm, ctx.spec.calibration
    convert = {n: cfg[n] for n in AXES if cfg.get(n) is not None and not AXES[n].after_student}
    if cfg.get("settings"):
        convert["settings"] = json.loads(cfg["settings"])
    settings = dict(d.settings)
    settings["seq_len"] = settings["seq_len"] or calibration.seq_len
    given = d.held_out or {}
    held = {
        name: (given[name].model_dump() if name in given else held_out_data(src.data))
        for name, src in calibration.sources.items()
    }
    return {"convert": convert, "dcdm": settings, "held_out": held, "n_samples": calibration.n_samples}


def mixture_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The configuration of a DCDM mixture: its base's axes, a key and variant label of its own."""
    base = cfg["config_key"]
    return {
        **cfg,
        "config_key": f"{base}|{SUFFIX}",
        "variant": SUFFIX,
        "variant_of": base,
        "dcdm_of": base,
        "note": f"calibration mixed by DCDM (the dcdm job of {base})",
    }


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    d = ctx.spec.dcdm
    if d is None:
        return {}
    tparams, tdeps, resident = teacher_ref(ctx)
    calib = ctx.jobs.get("calibrate", {})
    chosen = [
        c
        for c in ctx.configs
        if c["kind"] in CONVERTED_KINDS
        and c.get("dcdm_of") is None
        and c.get("variant_of") is None  # not a variant (one calibrated on one source alone: nothing to mix)
        and c["config_key"] in calib
        and matches(c, d.apply_to)
    ]
    if not chosen:
        raise SpecError(f"dcdm.apply_to: {d.apply_to} matches no configuration of the grid")
    for c in chosen:  # each round compresses from mixed statistics alone: no max activations reach it
        if wants_maxima(c):
            raise SpecError(
                f"dcdm.apply_to: {d.apply_to} matches {c['config_key']}, which reads the expert_maxima pass "
                "(scoring max_activations or super_experts: reap) that DCDM's rounds do not run; narrow "
                "dcdm.apply_to to leave it out"
            )
    out = {}
    for c in chosen:
        deps = {**tdeps, "calibrate": calib[c["config_key"]].key}
        out[c["config_key"]] = ctx.job(
            "dcdm", {"teacher": tparams, **dcdm_params(ctx, c)}, deps, resident=resident
        )
    if ctx.add_configs is not None:  # a dry run adds none: they are planned once DCDM ran
        ctx.add_configs([mixture_config(c) for c in chosen])
    return out


def mixture(ctx: SweepContext, cfg: dict[str, Any]) -> tuple[dict[str, float], JobSpec] | None:
    """(the DCDM weights, the dcdm job) of a DCDM mixture's configuration once its DCDM succeeded, else None."""
    base = cfg["dcdm_of"]
    out = ctx.succeeded("dcdm", base)
    return None if out is None else (out["weights"], ctx.jobs["dcdm"][base])


def after(ctx: SweepContext) -> None:
    """Each mixture's configuration notes its weights and why DCDM stopped."""
    notes = {}
    for base, job in ctx.jobs.get("dcdm", {}).items():
        out = ctx.outputs.get("dcdm", {}).get(job.key)
        if out is not None:
            w = ", ".join(f"{name}={v:.3f}" for name, v in out["weights"].items())
            notes[f"{base}|{SUFFIX}"] = {
                "note": f"calibration mixed by DCDM of {base}: {w} "
                f"(stop: {out['stop']} after {out['rounds']} rounds)"
            }
    if notes and ctx.set_fields is not None:
        ctx.set_fields(notes)


STAGE = Stage(
    name="dcdm",
    run="workers.run.dcdm:stage_dcdm",
    jobs=jobs,
    section="dcdm",
    params=DCDMSection,
    upstream=("calibrate",),
    records=frozenset({"outputs", "metrics", "artifacts"}),
    after=after,
    summary="dynamic calibration mixing per configuration; each adds a configuration <key>|calibration=dcdm",
)
