"""calibrate: one pass of the teacher over calibration data, reduced to sufficient statistics per MoE
layer (selection counts, router probability sums, activation norms, the experts' Gram matrix).

One job per (teacher, data, seq_len, n_samples, seed): every configuration and every sweep that names
the same calibration reuses it (and one more per further seed of a sweep's `seeds`). Calibration data is either one `data` source or several named
`sources` with weights: the job computes each source's statistics apart (a pass over its own windows)
and stores them in one file; loading mixes them (workers.calibration.calibrate.mix_stats: each source contributes
its weight's share of a token average).
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, StrictBool, StrictInt, field_validator, model_serializer, model_validator

from db.axes import CONVERTED_KINDS
from orchestrator.schema import Data, PosInt, Strict
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref

SOURCE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")  # no '.': it separates the stats file's keys


class CalibrationSource(Strict):
    """One named calibration source: its data, its mixing weight, and its samples (default: the section's)."""

    data: Data
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)]
    n_samples: PosInt | None = None


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

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict[str, Any]:
        """Leaves sample_tokens, streamed and offload_hidden out while they are unset, so calibrations that
        do not use them keep their job keys."""
        out = handler(self)
        for name in ("sample_tokens", "streamed", "offload_hidden"):
            if not getattr(self, name):
                out.pop(name, None)
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


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """One job for every configuration, plus one per further seed of `seeds` (labelled `seed=<s>`: what the
    seed repeats of the selected students are converted from; stages/seeds.py)."""
    from orchestrator.stages.seeds import seeded_calibrations

    tparams, tdeps, resident = teacher_ref(ctx)
    params = {"teacher": tparams, **calibration_params(ctx.spec.calibration)}
    job = ctx.job("calibrate", params, tdeps, resident=resident)
    out = {c["config_key"]: job for c in ctx.configs if c["kind"] in CONVERTED_KINDS}
    return out | seeded_calibrations(ctx, params, tdeps, resident)


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
    summary="one pass per calibration source, shared by every configuration",
)
