"""calibrate: one pass of the teacher over calibration data, reduced to sufficient statistics per MoE
layer (selection counts, router probability sums, activation norms, the experts' Gram matrix).

One job per (teacher, data, seq_len, n_samples, seed): every configuration and every sweep that names
the same calibration reuses it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, StrictInt, model_serializer

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
    # real tokens kept per MoE layer beside the sums (block inputs, router probabilities and their windows):
    # what reconstruction-loss selection (RL-exhaustive, RL-greedy, CFES) evaluates a layer on; 0 = none
    sample_tokens: Annotated[StrictInt, Field(ge=0)] = 0

    @model_serializer(mode="wrap")
    def _dump(self, handler) -> dict[str, Any]:
        """Leaves sample_tokens out while it is 0, so calibrations without samples keep their job keys."""
        out = handler(self)
        if not self.sample_tokens:
            out.pop("sample_tokens", None)
        return out


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    tparams, tdeps, resident = teacher_ref(ctx)
    job = ctx.job("calibrate", {"teacher": tparams, **ctx.spec.calibration.model_dump()}, tdeps, resident=resident)
    return {c["config_key"]: job for c in ctx.configs if c["kind"] == "moe2dense"}


STAGE = Stage(
    name="calibrate", run="workers.stages:stage_calibrate", jobs=jobs, section="calibration", params=Calibration,
    section_default="default", upstream=("teacher",), shared=True,
    records=frozenset({"outputs", "metrics", "artifacts"}),
    summary="one pass, shared by every configuration")
