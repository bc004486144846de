"""expert_maxima: per MoE layer and expert, the largest signed output element over its routed calibration
tokens (REAP's `max_activations`), the statistic of REAP's super-expert rule (`super_experts: reap`).

A pass of its own rather than a field of `calibrate`, so every stored calibration keeps its key. Planned
only when some configuration of the sweep asks for `super_experts: reap` or scores by `max_activations`: one
job per calibration those configurations use (teacher, data or sources, seq_len, n_samples, seed: the calibrate job's own windows),
shared by them; their conversions depend on it and read its file (workers.calibration.expert_maxima).
"""

from __future__ import annotations

import json
import math
from typing import Any

from db.axes import CONVERTED_KINDS
from orchestrator.schema import SpecError
from orchestrator.stage import JobSpec, Stage, SweepContext
from orchestrator.stages.teacher import teacher_ref

RULE = "reap"  # the `super_experts` value that needs this stage (workers.methods.pruning.REAP_RULE)
SCORING = "max_activations"  # the scoring that reads it (workers.methods.scoring)
# what only the calibrate pass reads (streamed and offload_hidden are this pass's settings too)
CALIBRATION_ONLY = ("sample_tokens",)


def wants_maxima(cfg: dict[str, Any]) -> bool:
    """Whether a configuration reads the max activations: its scoring is max_activations, or it protects super
    experts by REAP's rule; a `super_experts` that is neither a factor nor 'reap' is a SpecError here, before
    anything runs (the worker checks it again)."""
    if cfg["kind"] not in CONVERTED_KINDS:
        return False
    if cfg.get("scoring") == SCORING:
        return True
    if cfg.get("output") != "moe":
        return False
    value = (json.loads(cfg.get("settings") or "null") or {}).get("super_experts")
    if value is None or value == RULE:
        return value == RULE
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value >= 1)
    ):
        raise SpecError(
            f"grid: {cfg['config_key']}: super_experts={value!r}; allowed: a number >= 1 (our rule, a factor "
            "of the layer's median peak routed output norm) or 'reap' (REAP's rule on max activations)"
        )
    return False


def jobs(ctx: SweepContext) -> dict[str, JobSpec]:
    """One job per distinct calibration of the configurations that ask (their calibrate jobs' teacher,
    windows, batches and chunks, and whether the teacher is streamed; not the sampled tokens, which only the
    calibrate pass reads), shared by them. Params a resident calibration leaves out (streamed,
    offload_hidden) stay out here too, so a resident teacher's maxima job keeps its parameters."""
    _, tdeps, resident = teacher_ref(ctx)
    out: dict[str, JobSpec] = {}
    planned: dict[str, JobSpec] = {}  # by the calibrate job's key
    for c in ctx.configs:
        calib = ctx.jobs.get("calibrate", {}).get(c["config_key"])
        if calib is None or not wants_maxima(c):
            continue
        if calib.key not in planned:
            params = {k: v for k, v in calib.params.items() if k not in CALIBRATION_ONLY}
            planned[calib.key] = ctx.job("expert_maxima", params, tdeps, resident=resident)
        out[c["config_key"]] = planned[calib.key]
    return out


STAGE = Stage(
    name="expert_maxima",
    run="workers.run.expert_maxima:stage_expert_maxima",
    jobs=jobs,
    upstream=("teacher", "calibrate"),
    static=True,
    shared=True,
    records=frozenset({"outputs", "artifacts"}),
    summary="per-expert max activations (REAP's super-expert rule, the max_activations scoring), only when a "
    "configuration asks",
)
