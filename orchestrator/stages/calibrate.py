"""calibrate: one pass of the teacher over calibration data, reduced to sufficient statistics per MoE
layer (selection counts, router probability sums, activation norms, the experts' Gram matrix).

One job per (teacher, data, seq_len, n_samples, seed): every configuration and every sweep that names
the same calibration reuses it.
"""

from __future__ import annotations

from pydantic import Field

from orchestrator.schema import Data, PosInt, Strict
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref


class Calibration(Strict):
    data: Data = Field(default_factory=Data)
    n_samples: PosInt = 256
    seq_len: PosInt = 128
    seed: int = 1234
    batch_size: PosInt = 16
    chunk_tokens: PosInt = 2048


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    tparams, tdeps, resident = teacher_ref(ctx)
    job = ctx.job("calibrate", {"teacher": tparams, **ctx.spec.calibration.model_dump()}, tdeps, resident=resident)
    return {c["config_key"]: job for c in ctx.configs if c["kind"] == "moe2dense"}


STAGE = Stage(
    name="calibrate", run="workers.stages:stage_calibrate", jobs=jobs, section="calibration", params=Calibration,
    section_default="default", upstream=("teacher",), shared=True,
    records=frozenset({"outputs", "metrics", "artifacts"}),
    summary="one pass, shared by every configuration")
