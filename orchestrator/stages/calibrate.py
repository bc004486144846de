"""calibrate: one pass of the teacher over calibration data, reduced to sufficient statistics per MoE
layer (selection counts, router probability sums, activation norms, the experts' Gram matrix).

One job per (teacher, data, seq_len, n_samples, seed): every configuration and every sweep that names
the same calibration reuses it (and one more per further seed of a sweep's `seeds`). Calibration data is either one `data` source or several named
`sources` with weights: the job computes each source's statistics apart (a pass over its own windows)
and stores them in one file; loading mixes them (workers.calibration.calibrate.mix_stats: each source contributes
its weight's share of a token average).

`single_source` makes, for each configuration it applies to, one variant per named source:
`<config_key>|calibration=<source>` (variant `calibration=<source>`, `variant_of` its base), the same
conversion calibrated on that source alone, from a calibrate job of its own (that source as the one
`data`, `single_source.n_samples` windows; the teacher, seq_len, seed and the rest as the section's).
Configurations calibrated on the same source share that job, and so does any sweep calibrated on that
data alone. As a variant it never competes with its base in the selection rule.

Named calibrations: the sweep's `calibrations` maps names to further sections of this form, and a
sub-grid's `calibration: <name>` has its configurations calibrated by that section's job (its own key;
sub-grids naming one section share its job) instead of the `calibration` section's, which serves every
other configuration. A configuration keeps its plain key unless sub-grids calibrate it more than one
way: then each named one is `<config_key>|calibration=<name>`, a configuration of its own (no variant:
it competes in the selection rule like any other). Its `note` names the section.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from db.axes import CONVERTED_KINDS
from orchestrator.axes import AXES
from orchestrator.schema import Data, PosInt, SpecError, Strict
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref

SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # no '.': it separates the stats file's keys
LABEL = "calibration"  # a single-source variant's label is `calibration=<source>`, the tail of its key
RESERVED = ("dcdm",)  # labels of other calibration variants (stages/dcdm.py: `calibration=dcdm`)


class CalibrationSource(Strict):
    """One named calibration source: its data, its mixing weight, and its samples (default: the section's)."""

    data: Data
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    n_samples: PosInt | None = None


def check_apply_to(v: dict[str, Any]) -> dict[str, Any]:
    """An `apply_to` mapping: axis -> a value or a non-empty list of values."""
    for name, value in v.items():
        if name not in AXES:
            raise ValueError(f"{name!r} is not an axis; allowed: {', '.join(AXES)}")
        values = value if isinstance(value, list) else [value]
        if not values or any(not isinstance(x, str | int) or isinstance(x, bool) for x in values):
            raise ValueError(f"{name}: a value or a non-empty list of values, got {value!r}")
    return v


class SingleSource(Strict):
    """One more configuration per named source and configuration it applies to, calibrated on that
    source alone (a calibrate job of its own with `n_samples` windows of it)."""

    sources: list[str] | None = None  # the calibration sources to run alone; default: every one
    n_samples: PosInt | None = None  # windows of the source per run; default: calibration.n_samples
    # axis -> value (or list of values); or a list of such mappings, any of which a configuration may match
    # (default: every converted configuration)
    apply_to: dict[str, Any] | list[dict[str, Any]] = Field(default_factory=dict)

    @field_validator("sources")
    @classmethod
    def _sources(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("name at least one calibration source (or leave sources out: every source)")
        twice = sorted({n for n in v if v.count(n) > 1})
        if twice:
            raise ValueError(f"{', '.join(map(repr, twice))} named twice")
        return v

    @field_validator("apply_to")
    @classmethod
    def _apply_to(cls, v: dict[str, Any] | list[dict[str, Any]]) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(v, list):
            if not v:
                raise ValueError("a mapping (axis: values) or a non-empty list of mappings")
            return [check_apply_to(m) for m in v]
        return check_apply_to(v)

    def applies(self, cfg: dict[str, Any]) -> bool:
        """Whether a configuration gets single-source variants (it matches apply_to, or one of its mappings)."""
        from orchestrator.stages.dcdm import matches

        alts = self.apply_to if isinstance(self.apply_to, list) else [self.apply_to]
        return any(matches(cfg, a) for a in alts)


class Calibration(Strict):
    data: Data | None = None  # one source (named 'default', weight 1); the default: the tiny corpus
    sources: dict[str, CalibrationSource] | None = None  # or several, mixed by weight
    n_samples: PosInt = 256
    seq_len: PosInt = 128
    seed: int = 1234
    batch_size: PosInt = 16
    chunk_tokens: PosInt = 2048
    # real tokens kept per MoE layer beside the sums (block inputs, router probabilities and their windows):
    # what reconstruction-loss selection (RL-exhaustive, RL-greedy, CFES) evaluates a layer on; 0 = none
    sample_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    # read the teacher from its safetensors shards one decoder layer at a time (workers.calibration.streamed): a teacher
    # larger than one device; the statistics are those of the resident pass
    streamed: StrictBool = False
    offload_hidden: StrictBool = False  # streamed: the calibration set's hidden states wait on the CPU
    # configurations calibrated on one source alone, beside the mixed ones (variants `calibration=<source>`)
    single_source: SingleSource | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict[str, Any]:
        """Leaves sample_tokens, streamed and offload_hidden out while they are unset, so calibrations that
        do not use them keep their job keys, and single_source always: it plans configurations, it is no
        part of a calibration pass (nor of what a job reads of the section)."""
        out = handler(self)
        for name in ("sample_tokens", "streamed", "offload_hidden"):
            if not getattr(self, name):
                out.pop(name, None)
        out.pop("single_source", None)
        return out

    @field_validator("sources")
    @classmethod
    def _names(cls, v: dict[str, CalibrationSource] | None) -> dict[str, CalibrationSource] | None:
        if v is None:
            return v
        if not v:
            raise ValueError("name at least one source (name: {data, weight})")
        for name in v:
            if not SOURCE_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a source name; allowed: letters, digits, '_', '-' "
                    "(starting with a letter or digit, at most 64)"
                )
        return v

    @field_validator("single_source")
    @classmethod
    def _single_source(cls, v: SingleSource | None, info: ValidationInfo) -> SingleSource | None:
        if v is None:
            return v
        sources = info.data.get("sources")
        if not sources:  # `data` (one source) or sources that are wrong themselves (their own error)
            if "sources" in info.data:
                raise ValueError(
                    "needs calibration.sources (named sources): with one `data` source the mixed run is "
                    "already that source alone"
                )
            return v
        for name in v.sources or []:
            if name not in sources:
                raise ValueError(
                    f"{name!r} is not a calibration source (calibration.sources); allowed: {', '.join(sources)}"
                )
        for name in v.sources or list(sources):
            if name in RESERVED:
                raise ValueError(
                    f"source {name!r}: its variant `{LABEL}={name}` would be the DCDM mixture's key; "
                    "rename the source"
                )
        return v

    @model_validator(mode="after")
    def _one_of(self) -> Calibration:
        if self.data is not None and self.sources is not None:
            raise ValueError("data and sources are mutually exclusive: give data (one source) or sources")
        if self.sources is None and self.data is None:
            self.data = Data()
        if self.offload_hidden and not self.streamed:
            raise ValueError("offload_hidden applies to a streamed calibration: set streamed: true")
        return self


def named_sections(v: dict[str, Calibration] | None) -> dict[str, Calibration] | None:
    """The sweep's `calibrations` checked: names as source names are (a name may end a configuration key),
    none a reserved label, and no `single_source` (its variants come from the `calibration` section)."""
    if v is None:
        return v
    if not v:
        raise ValueError("name at least one calibration (name: {a calibration section}), or leave it out")
    for name, c in v.items():
        if not SOURCE_NAME.fullmatch(name):
            raise ValueError(
                f"{name!r} is not a calibration name; allowed: letters, digits, '_', '-' "
                "(starting with a letter or digit, at most 64)"
            )
        if name in RESERVED:
            raise ValueError(f"{name!r}: `{LABEL}={name}` is the DCDM mixture's key tail; rename it")
        if c.single_source is not None:
            raise ValueError(
                f"{name}.single_source: single-source variants come from the calibration section only "
                "(of the configurations it calibrates); remove it here"
            )
    return v


def check_rows(grid: Any, named: dict[str, Calibration] | None) -> Any:
    """Each sub-grid's `calibration` names a section of `calibrations` (ValueError line otherwise)."""
    rows = grid if isinstance(grid, list) else [grid]
    allowed = ", ".join(named or {}) or "none: the sweep has no calibrations section"
    for i, row in enumerate(rows):
        name = row.calibration
        if name is not None and name not in (named or {}):
            where = f"sub-grid {i + 1}: " if isinstance(grid, list) else ""
            raise ValueError(f"{where}calibration {name!r} is not a name in calibrations; allowed: {allowed}")
    return grid


def pass_text(params: dict[str, Any]) -> str:
    """A calibrate job's windows per source, e.g. `mixed c4 11 + math 11 + code 10` or `256`."""
    if params.get("sources"):
        return "mixed " + " + ".join(f"{n} {s['n_samples']}" for n, s in params["sources"].items())
    return f"{params['n_samples']}"


def named_configs(spec, configs: list[dict[str, Any]]) -> None:
    """Notes on each configuration a named calibration calibrates (which section, what it reads), in place.
    SpecError where another part of the sweep would calibrate it by the `calibration` section: DCDM (it
    mixes that section's sources) and seed repeats of a dense student (that section's seeds)."""
    from orchestrator.stages.dcdm import matches
    from orchestrator.stages.seeds import offsets

    named = [c for c in configs if c.get("calibration") is not None]
    dcdm = getattr(spec, "dcdm", None)
    for c in named:
        name = c["calibration"]
        params = calibration_params(spec.calibrations[name])
        c["note"] = (
            f"calibrated by calibrations.{name}: {pass_text(params)} windows of {params['seq_len']} tokens"
        )
        if dcdm is not None and matches(c, dcdm.apply_to):
            raise SpecError(
                f"dcdm.apply_to: {dcdm.apply_to} matches {c['config_key']}, calibrated by calibrations.{name}; "
                "DCDM mixes the calibration section's sources: narrow apply_to to that section's configurations"
            )
        if offsets(spec) and c["kind"] == "moe2dense":
            raise SpecError(
                f"seeds: a selected dense student is repeated on the calibration section's seeds; "
                f"{c['config_key']} is calibrated by calibrations.{name}: not supported, leave seeds out"
            )


def calibration_params(c: Calibration) -> dict[str, Any]:
    """The job's parameters. A single `data` keeps the layout it always had; `sources` gives each source
    its data, weight and resolved n_samples (the weights are in the key: the stored file's default mix)."""
    base = c.model_dump(exclude={"data", "sources"})
    if c.sources is None:
        return {**base, "data": c.data.model_dump()}
    del base["n_samples"]
    return {
        **base,
        "sources": {
            name: {"data": s.data.model_dump(), "weight": s.weight, "n_samples": s.n_samples or c.n_samples}
            for name, s in c.sources.items()
        },
    }


def single_source_names(c: Calibration) -> list[str]:
    """The sources a single-source variant is made for, in order (none without `single_source`)."""
    if c.single_source is None or not c.sources:
        return []
    return list(c.single_source.sources or c.sources)


def single_source_calibration(c: Calibration, name: str) -> Calibration:
    """The calibration of a single-source variant: source `name` as the one `data`, with
    single_source.n_samples windows; everything else (seq_len, seed, batches, sample_tokens...) the
    section's. Its job is what a sweep calibrated on that data alone would run."""
    n = c.single_source.n_samples if c.single_source is not None else None
    return c.model_copy(
        update={
            "data": c.sources[name].data,
            "sources": None,
            "single_source": None,
            "n_samples": n or c.n_samples,
        }
    )


def source_config(cfg: dict[str, Any], name: str, n_samples: int) -> dict[str, Any]:
    """A configuration's variant calibrated on source `name` alone: its axes, a key and label of its own."""
    base, label = cfg["config_key"], f"{LABEL}={name}"
    return {
        **cfg,
        "config_key": f"{base}|{label}",
        "variant": label,
        "variant_of": base,
        "calibration_source": name,
        "note": f"calibrated on {name} alone ({n_samples} samples; {base} on the mix)",
    }


def single_source_configs(spec, configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The single-source variants of the converted configurations `single_source` applies to (for each
    configuration, one per source in the section's order). SpecError when apply_to matches none."""
    c = spec.calibration
    names = single_source_names(c)
    if not names:
        return []
    chosen = [
        g
        for g in configs
        if g["kind"] in CONVERTED_KINDS and g.get("calibration") is None and c.single_source.applies(g)
    ]
    if not chosen:
        raise SpecError(
            f"calibration.single_source.apply_to: {c.single_source.apply_to} matches no configuration of the grid"
            + (
                " that the calibration section calibrates"
                if any(g.get("calibration") for g in configs)
                else ""
            )
        )
    n = c.single_source.n_samples or c.n_samples
    return [source_config(g, name, n) for g in chosen for name in names]


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """One job for every configuration, plus one per further seed of `seeds` (labelled `seed=<s>`: what the
    seed repeats of the selected students are converted from; stages/seeds.py), plus one per source of
    `single_source` for the variants calibrated on it alone, and one per named calibration a sub-grid
    chooses. A launch stores each single-source variant's link to its base (variant_of) here, before
    anything reads the selection rule."""
    from orchestrator.stages.seeds import seeded_calibrations

    c = ctx.spec.calibration
    tparams, tdeps, resident = teacher_ref(ctx)
    params = {"teacher": tparams, **calibration_params(c)}
    job = ctx.job("calibrate", params, tdeps, resident=resident)
    alone: dict[str, JobSpec] = {}
    named: dict[str, JobSpec] = {}
    out: dict[str, JobSpec] = {}
    variants = []
    for cfg in ctx.configs:
        if cfg["kind"] not in CONVERTED_KINDS:
            continue
        section = cfg.get("calibration")
        if section is not None:
            if section not in named:
                one = {"teacher": tparams, **calibration_params(ctx.spec.calibrations[section])}
                named[section] = ctx.job("calibrate", one, tdeps, resident=resident)
            out[cfg["config_key"]] = named[section]
            continue
        name = cfg.get("calibration_source")
        if name is None:
            out[cfg["config_key"]] = job
            continue
        if name not in alone:
            one = {"teacher": tparams, **calibration_params(single_source_calibration(c, name))}
            alone[name] = ctx.job("calibrate", one, tdeps, resident=resident)
        out[cfg["config_key"]] = alone[name]
        variants.append(cfg)
    if variants and ctx.add_configs is not None:  # stored already; this links each to its base
        ctx.add_configs(variants)
    return out | seeded_calibrations(ctx, params, tdeps, resident)


def plan_note(ctx: SweepContext) -> str:
    """What the planned calibrate jobs read, for the dry run: each distinct job's windows of seq_len
    tokens per source, e.g. `4 passes of 4096-token windows: mixed c4 11 + math 11 + code 10; c4 alone 32;
    ...`; a named calibration's pass after its name (`td_moe: 256`), and where the passes' windows differ,
    each pass's (`td_moe: 256 of 2048`). `ctx.jobs['calibrate']` must be planned."""
    planned = ctx.jobs.get("calibrate", {})
    alone = {
        planned[c["config_key"]].key: c["calibration_source"]
        for c in ctx.configs
        if c.get("calibration_source") and c["config_key"] in planned
    }
    names: dict[str, list[str]] = {}  # job key -> the named calibrations it is
    for c in ctx.configs:
        if c.get("calibration") and c["config_key"] in planned:
            at = names.setdefault(planned[c["config_key"]].key, [])
            at += [c["calibration"]] if c["calibration"] not in at else []
    default = {  # the calibration section's own pass
        planned[c["config_key"]].key
        for c in ctx.configs
        if c["config_key"] in planned and not c.get("calibration") and not c.get("calibration_source")
    }
    parts: dict[str, tuple[str, int]] = {}
    for label, job in planned.items():
        if job.key in parts:
            continue
        p = job.params
        what = f"{alone[job.key]} alone {p['n_samples']}" if job.key in alone else pass_text(p)
        if job.key in names:  # a named section's (also the calibration section's when their passes are equal)
            shared = ["calibration"] if job.key in default else []
            what = f"{', '.join(shared + names[job.key])}: {what}"
        elif names and job.key in default:
            what = f"calibration: {what}"
        parts[job.key] = (what + (f" ({label})" if label.startswith("seed=") else ""), p["seq_len"])
    if not parts:
        return ""
    n = len(parts)
    seq = sorted({s for _, s in parts.values()})
    if len(seq) == 1 or not names:
        windows = "/".join(str(s) for s in seq)
        return f"{n} pass{'es' if n > 1 else ''} of {windows}-token windows: " + "; ".join(
            w for w, _ in parts.values()
        )
    return f"{n} passes of token windows: " + "; ".join(f"{w} of {s}" for w, s in parts.values())


STAGE = Stage(
    name="calibrate",
    run="workers.run.calibrate:stage_calibrate",
    jobs=jobs,
    section="calibration",
    params=Calibration,
    section_default="default",
    upstream=("teacher",),
    shared=True,
    records=frozenset({"outputs", "metrics", "artifacts"}),
    summary="one pass per calibration source, shared by every configuration (and one per source that "
    "single_source variants calibrate on alone, one per named calibration a sub-grid chooses)",
    describe=plan_note,
)
