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
    chosen = [g for g in configs if g["kind"] in CONVERTED_KINDS and c.single_source.applies(g)]
    if not chosen:
        raise SpecError(
            f"calibration.single_source.apply_to: {c.single_source.apply_to} matches no configuration of the grid"
        )
    n = c.single_source.n_samples or c.n_samples
    return [source_config(g, name, n) for g in chosen for name in names]


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """One job for every configuration, plus one per further seed of `seeds` (labelled `seed=<s>`: what the
    seed repeats of the selected students are converted from; stages/seeds.py), plus one per source of
    `single_source` for the variants calibrated on it alone. A launch stores each such variant's link to
    its base (variant_of) here, before anything reads the selection rule."""
    from orchestrator.stages.seeds import seeded_calibrations

    c = ctx.spec.calibration
    tparams, tdeps, resident = teacher_ref(ctx)
    params = {"teacher": tparams, **calibration_params(c)}
    job = ctx.job("calibrate", params, tdeps, resident=resident)
    alone: dict[str, JobSpec] = {}
    out: dict[str, JobSpec] = {}
    variants = []
    for cfg in ctx.configs:
        if cfg["kind"] not in CONVERTED_KINDS:
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
    ...`. `ctx.jobs['calibrate']` must be planned."""
    alone = {
        ctx.jobs["calibrate"][c["config_key"]].key: c["calibration_source"]
        for c in ctx.configs
        if c.get("calibration_source") and c["config_key"] in ctx.jobs.get("calibrate", {})
    }
    parts: dict[str, str] = {}
    seq: set[int] = set()
    for label, job in ctx.jobs.get("calibrate", {}).items():
        if job.key in parts:
            continue
        p = job.params
        seq.add(p["seq_len"])
        if p.get("sources"):
            what = "mixed " + " + ".join(f"{n} {s['n_samples']}" for n, s in p["sources"].items())
        elif job.key in alone:
            what = f"{alone[job.key]} alone {p['n_samples']}"
        else:
            what = f"{p['n_samples']}"
        parts[job.key] = what + (f" ({label})" if label.startswith("seed=") else "")
    if not parts:
        return ""
    n = len(parts)
    windows = "/".join(str(s) for s in sorted(seq))
    return f"{n} pass{'es' if n > 1 else ''} of {windows}-token windows: " + "; ".join(parts.values())


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
    "single_source variants calibrate on alone)",
    describe=plan_note,
)
